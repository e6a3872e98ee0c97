"""Helpers of the KV data-path tests: a real DurableCache and a real Session, and the calls."""

import asyncio
import contextlib
import re

import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.api.tensors import from_kv_chunk, to_kv_chunk
from prefixd.daemon import kv_rpc
from prefixd.daemon.sessions import SessionTable
from prefixd.daemon.status import RpcFailure
from tests.engine.factory import cache_factory

BS = 4
LAYOUT = KVLayout("kv-rpc", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=BS)
MAX_BYTES = 1 << 20


@contextlib.contextmanager
def sessions(tmp_path, layout=LAYOUT, sizes=(64, 64, 0)):
    """Yields ``(pool, table)``: one DurableCache and a SessionTable over it."""
    with cache_factory(tmp_path, layout, sizes) as make:
        yield make(), SessionTable(lease_s=60.0)


def open_seq(session, tokens):
    """Open ``tokens`` for ``session`` as the servicer does (the session then owns it)."""
    seq = session.pool.open(tokens, session_id=session.id)
    session.track(seq.id, len(seq.block_table))
    return seq


def kv_for(first: int, n: int, seed: int = 0, layout=LAYOUT) -> torch.Tensor:
    """KV of tokens ``first .. first + n``: every value says its token, layer, K/V and lane."""
    pos = torch.arange(first, first + n, dtype=torch.float32).view(1, 1, n, 1, 1)
    layer = torch.arange(layout.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    kv = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    lane = torch.arange(layout.num_kv_heads * layout.head_dim, dtype=torch.float32)
    lane = lane.view(1, 1, 1, layout.num_kv_heads, layout.head_dim)
    out = seed * 1e4 + pos * 100 + layer * 10 + kv * 5 + lane / 10
    return out.to(layout.torch_dtype())


def request(session, seq_id, start, kv) -> pb.WriteKVRequest:
    req = pb.WriteKVRequest(session_id=session.id)
    to_kv_chunk(seq_id, start, kv, out=req.chunk)
    return req


def write(session, requests, max_bytes=MAX_BYTES) -> int:
    """Run ``kv_rpc.write_kv`` over ``requests`` as a stream; returns the tokens written."""
    async def stream():
        for r in requests:
            yield r

    reply = asyncio.run(kv_rpc.write_kv(session, stream(), max_bytes))
    return reply.written_tokens


def read_chunks(session, seq_id, start, n, max_bytes=MAX_BYTES) -> list[pb.ReadKVReply]:
    req = pb.ReadKVRequest(session_id=session.id, seq_id=seq_id, start=start, num_tokens=n)
    # the daemon yields encoded replies (prefixd.daemon.handlers passes them on)
    return [pb.ReadKVReply.FromString(b) for b in kv_rpc.read_kv(session, req, max_bytes)]


def read(session, seq_id, start, n, max_bytes=MAX_BYTES) -> torch.Tensor:
    return torch.cat([from_kv_chunk(r.chunk) for r in read_chunks(session, seq_id, start, n,
                                                                  max_bytes)], dim=2)


def state(pool) -> tuple:
    """What a refused call must leave as it was: every pool byte, the sequences, the index."""
    pool.check_invariants()
    seqs = tuple((s.id, bytes(s.tokens), tuple(s.block_table), s.num_indexed)
                 for s in pool.cache.sequences())
    tiers = tuple(pool.store.pool(t).tensor.clone() for t in (0, 1))
    return seqs, pool.cache.stats.committed_blocks, pool.cache.shared_tails(), tiers


def assert_same_state(before, after) -> None:
    assert before[:3] == after[:3]
    for a, b in zip(before[3], after[3]):
        assert torch.equal(a, b)


def refusal(call) -> RpcFailure:
    """The ``RpcFailure`` ``call()`` raises (fails the test if it raises nothing)."""
    try:
        call()
    except RpcFailure as failure:
        return failure
    raise AssertionError("the call was not refused")


def assert_refused_unchanged(call, pool, table, code, words: str) -> None:
    """``call()`` is refused with ``code`` and a message that ``words`` (a regex) finds, and
    leaves every pool byte, the sequences and the index as they were (``state``)."""
    before = state(pool)
    failure = refusal(call)
    assert failure.code is code, failure
    assert re.search(words, failure.message), failure.message
    assert_same_state(before, state(pool))
    table.check_invariants()
