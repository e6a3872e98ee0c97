"""Attend (prefixd.daemon.kv_rpc.attend): paged attention over the session's pool, checked
against dense attention over the KV read back from the pool."""

import re

import grpc
import pytest
import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.api.tensors import from_tensor_msg, to_tensor_msg
from prefixd.daemon import kv_rpc
from tests.daemon.kv_rpc_helpers import (
    LAYOUT, MAX_BYTES, assert_refused_unchanged, open_seq, refusal, sessions,
)

Code = grpc.StatusCode
Q_HEADS = 4  # over LAYOUT's 2 KV heads: GQA groups of 2


@pytest.fixture
def env(tmp_path):
    """``(pool, table, session)`` with random KV written for three sequences (7, 13, 4 tokens)."""
    with sessions(tmp_path) as (pool, table):
        s = table.attach("t", "engine-0", LAYOUT, pool)
        g = torch.Generator().manual_seed(0)
        for i, n in enumerate((7, 13, 4)):
            seq = open_seq(s, list(range(100 * i, 100 * i + n)))
            kv = torch.randn((LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)
            pool.write_kv(seq, 0, kv.to(LAYOUT.torch_dtype()))
        yield pool, table, s


def dense(pool, seq_id, layer, q, scale=None):
    """Attention of ``q`` (the sequence's last ``len(q)`` tokens) over its KV, causally, read
    back from the pool and computed densely in fp32."""
    n_tok = pool.sequence(seq_id).num_tokens
    kv = pool.read_kv(seq_id, 0, n_tok)[layer].float()  # [2, T, kv_heads, dim]
    k = kv[0].repeat_interleave(Q_HEADS // LAYOUT.num_kv_heads, dim=1)  # [T, q_heads, dim]
    v = kv[1].repeat_interleave(Q_HEADS // LAYOUT.num_kv_heads, dim=1)
    n = q.shape[0]
    scores = torch.einsum("nhd,thd->hnt", q.float(), k) * (scale or LAYOUT.head_dim ** -0.5)
    pos = torch.arange(n_tok - n, n_tok)
    scores.masked_fill_(torch.arange(n_tok)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)


def seq_ids(pool):
    return [s.id for s in pool.cache.sequences()]


def attend_request(s, ids, q, layer=1, loc=None, new_k=None, new_v=None, scale=0.0):
    req = pb.AttendRequest(session_id=s.id, seq_ids=ids, layer=layer, query=to_tensor_msg(q),
                           scale=scale)
    if loc is not None:
        req.query_start_loc.extend(loc)
    if new_k is not None:
        req.new_k.CopyFrom(to_tensor_msg(new_k))
    if new_v is not None:
        req.new_v.CopyFrom(to_tensor_msg(new_v))
    return req


def attend(s, req, max_bytes=MAX_BYTES):
    reply = kv_rpc.attend(s, req, max_bytes)
    return from_tensor_msg(reply.output)


def test_decode_equals_dense_attention(env):
    pool, _, s = env
    ids = seq_ids(pool)
    q = torch.randn((3, Q_HEADS, LAYOUT.head_dim))
    out = attend(s, attend_request(s, ids, q, scale=0.3))
    assert out.shape == q.shape and out.dtype == torch.float32
    for b, sid in enumerate(ids):
        torch.testing.assert_close(out[b:b + 1], dense(pool, sid, 1, q[b:b + 1], 0.3))


def test_extend_equals_dense_causal_attention(env):
    pool, _, s = env
    ids = seq_ids(pool)
    counts = [3, 5, 4]  # the whole 4-token sequence is new
    loc = [0, 3, 8, 12]
    q = torch.randn((12, Q_HEADS, LAYOUT.head_dim))
    out = attend(s, attend_request(s, ids, q, layer=0, loc=loc))
    for b, sid in enumerate(ids):
        torch.testing.assert_close(out[loc[b]:loc[b + 1]], dense(pool, sid, 0, q[loc[b]:loc[b + 1]]))
    assert counts == [b - a for a, b in zip(loc, loc[1:])]


@pytest.mark.parametrize("extend", [False, True])
def test_new_kv_is_written_into_the_last_tokens_of_one_layer_first(env, extend):
    pool, _, s = env
    ids = seq_ids(pool)
    loc = [0, 2, 5, 6] if extend else None
    rows = 6 if extend else 3
    counts = [2, 3, 1] if extend else [1, 1, 1]
    q = torch.randn((rows, Q_HEADS, LAYOUT.head_dim))
    new_k = torch.randn((rows, LAYOUT.num_kv_heads, LAYOUT.head_dim))
    new_v = torch.randn((rows, LAYOUT.num_kv_heads, LAYOUT.head_dim))
    before = {sid: pool.read_kv(sid, 0, pool.sequence(sid).num_tokens) for sid in ids}
    out = attend(s, attend_request(s, ids, q, layer=1, loc=loc, new_k=new_k, new_v=new_v))
    at = 0
    for sid, n in zip(ids, counts):
        t = pool.sequence(sid).num_tokens
        want = before[sid].clone()
        want[1, 0, t - n:] = new_k[at:at + n]
        want[1, 1, t - n:] = new_v[at:at + n]
        torch.testing.assert_close(pool.read_kv(sid, 0, t), want, rtol=0, atol=0)  # layer 0 kept
        torch.testing.assert_close(out[at:at + n], dense(pool, sid, 1, q[at:at + n]))
        at += n


def test_attend_in_bfloat16_matches_dense_within_bf16_tolerance(tmp_path):
    layout = KVLayout("kv-rpc-bf16", num_layers=1, num_kv_heads=2, head_dim=8,
                      dtype="bfloat16", block_size=4)
    with sessions(tmp_path, layout) as (pool, table):
        s = table.attach("t", "e", layout, pool)
        seq = open_seq(s, list(range(10)))
        pool.write_kv(seq, 0, torch.randn((1, 2, 10, 2, 8)).to(torch.bfloat16))
        q = torch.randn((1, 2, 8)).to(torch.bfloat16)
        out = attend(s, attend_request(s, [seq.id], q, layer=0))
        assert out.dtype == torch.bfloat16
        kv = pool.read_kv(seq.id, 0, 10)[0].float()
        p = torch.softmax(torch.einsum("hd,thd->ht", q[0].float(), kv[0]) * 8 ** -0.5, dim=-1)
        torch.testing.assert_close(out[0].float(), torch.einsum("ht,thd->hd", p, kv[1]),
                                   rtol=2e-2, atol=2e-2)


# -- refusals: each changes nothing ------------------------------------------------------------

def _q(rows=3, heads=Q_HEADS, dim=4, dtype=torch.float32):
    return torch.randn((rows, heads, dim)).to(dtype)


def _kv(rows=3):
    return torch.randn((rows, LAYOUT.num_kv_heads, LAYOUT.head_dim))


def _bad_data(s, ids):
    req = attend_request(s, ids, _q())
    req.query.data = req.query.data[:-1]
    return req


def _into_committed(s, ids):
    s.pool.commit(ids[1], "index").result()  # 13 tokens: blocks 0..2 indexed, 12 private
    return attend_request(s, ids, _q(6), loc=[0, 1, 5, 6], new_k=_kv(6), new_v=_kv(6))


def _into_fork_tail(s, ids):
    (child,) = s.pool.fork(ids[0], 1)  # 7 tokens: block 1 (tokens 4..7) shared
    s.track(child.id, len(child.block_table))
    return attend_request(s, [child.id], _q(1), new_k=_kv(1), new_v=_kv(1))


def _not_owned(s, ids):
    return attend_request(s, [ids[0], 10_000], _q(2))


REFUSALS = [
    (lambda s, ids: attend_request(s, [], _q(0)), Code.INVALID_ARGUMENT, "at least one"),
    (lambda s, ids: attend_request(s, [ids[0], ids[0]], _q(2)), Code.INVALID_ARGUMENT, "twice"),
    (_not_owned, Code.NOT_FOUND, r"sequence \d+"),
    (lambda s, ids: attend_request(s, ids, _q(), layer=2), Code.INVALID_ARGUMENT, "layer 2 is out of range"),
    (lambda s, ids: pb.AttendRequest(session_id=s.id, seq_ids=ids), Code.INVALID_ARGUMENT, "needs a query"),
    (lambda s, ids: attend_request(s, ids, _q(heads=3)), Code.INVALID_ARGUMENT, "multiple of num_kv_heads=2"),
    (lambda s, ids: attend_request(s, ids, _q(dim=8)), Code.INVALID_ARGUMENT, "head_dim=4"),
    (lambda s, ids: attend_request(s, ids, _q(dtype=torch.float16)), Code.INVALID_ARGUMENT, "dtype must be"),
    (_bad_data, Code.INVALID_ARGUMENT, r"query: data is \d+ bytes"),
    (lambda s, ids: attend_request(s, ids, _q(4)), Code.INVALID_ARGUMENT, "one query row per sequence"),
    (lambda s, ids: attend_request(s, ids, _q(6), loc=[0, 2, 6]), Code.INVALID_ARGUMENT, "num_seqs \\+ 1 = 4"),
    (lambda s, ids: attend_request(s, ids, _q(6), loc=[1, 2, 4, 6]), Code.INVALID_ARGUMENT, "from 0"),
    (lambda s, ids: attend_request(s, ids, _q(6), loc=[0, 2, 4, 5]), Code.INVALID_ARGUMENT, "to the query's 6 rows"),
    (lambda s, ids: attend_request(s, ids, _q(6), loc=[0, 4, 3, 6]), Code.INVALID_ARGUMENT, "must not decrease"),
    (lambda s, ids: attend_request(s, ids, _q(0), loc=[0, 0, 0, 0]), Code.INVALID_ARGUMENT, "at least one query row"),
    (lambda s, ids: attend_request(s, ids, _q(9), loc=[0, 1, 2, 9]), Code.INVALID_ARGUMENT, "fewer than its 7 query rows"),
    (lambda s, ids: attend_request(s, ids, _q(), scale=-1.0), Code.INVALID_ARGUMENT, "scale must be"),
    (lambda s, ids: attend_request(s, ids, _q(), scale=float("nan")), Code.INVALID_ARGUMENT, "scale must be"),
    (lambda s, ids: attend_request(s, ids, _q(), new_k=_kv(), new_v=None), Code.INVALID_ARGUMENT, "together"),
    (lambda s, ids: attend_request(s, ids, _q(), new_k=_kv(2), new_v=_kv(2)), Code.INVALID_ARGUMENT, r"new_k shape must be \[3, 2, 4\]"),
    (_into_committed, Code.FAILED_PRECONDITION, "which is indexed"),
    (_into_fork_tail, Code.FAILED_PRECONDITION, "shared with forked siblings"),
]


@pytest.mark.parametrize("make,code,words", REFUSALS,
                         ids=[re.sub(r"\W+", "-", w).strip("-") for _, _, w in REFUSALS])
def test_attend_refusals_change_nothing(env, make, code, words):
    pool, table, s = env
    req = make(s, seq_ids(pool))
    assert_refused_unchanged(lambda: kv_rpc.attend(s, req, MAX_BYTES), pool, table, code, words)


def test_attend_refuses_an_output_over_the_message_limit(env):
    pool, _, s = env
    req = attend_request(s, seq_ids(pool), _q())
    failure = refusal(lambda: kv_rpc.attend(s, req, len(req.query.data) + 10))
    assert failure.code is Code.RESOURCE_EXHAUSTED and "split the batch" in failure.message


def test_attend_refuses_a_float8_layout(tmp_path):
    layout = KVLayout("kv-rpc-f8", num_layers=1, num_kv_heads=1, head_dim=4,
                      dtype="float8_e4m3fn", block_size=4)
    with sessions(tmp_path, layout) as (pool, table):
        s = table.attach("t", "e", layout, pool)
        seq = open_seq(s, [1, 2, 3])
        failure = refusal(lambda: kv_rpc.attend(s, pb.AttendRequest(session_id=s.id, seq_ids=[seq.id]),
                                                MAX_BYTES))
        assert failure.code is Code.INVALID_ARGUMENT and "compute attention in the client" in failure.message


def test_prepare_writes_the_new_kv_before_returning_the_kernel(env):
    """The write is the part that must run on the loop (it changes the pool); the returned
    callable only reads, so a servicer may run it on a worker thread."""
    pool, _, s = env
    ids = seq_ids(pool)
    q, new_k, new_v = _q(), _kv(), _kv()
    compute = kv_rpc.prepare_attend(s, attend_request(s, ids, q, new_k=new_k, new_v=new_v), MAX_BYTES)
    for b, sid in enumerate(ids):
        t = pool.sequence(sid).num_tokens
        torch.testing.assert_close(pool.read_kv(sid, t - 1, 1)[1, :, 0], torch.stack([new_k[b], new_v[b]]),
                                   rtol=0, atol=0)
    out = from_tensor_msg(compute().output)
    torch.testing.assert_close(out[:1], dense(pool, ids[0], 1, q[:1]))
