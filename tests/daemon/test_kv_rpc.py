"""WriteKV / ReadKV (prefixd.daemon.kv_rpc) over a real DurableCache and a real Session."""

import grpc
import numpy as np
import pytest
import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import from_kv_chunk, to_kv_chunk
from prefixd.daemon import kv_rpc
from prefixd.daemon.pool_descriptors import pool_descriptors
from tests.daemon.kv_rpc_helpers import (
    BS, LAYOUT, assert_refused_unchanged, kv_for, open_seq, read, read_chunks, refusal, request,
    sessions, write,
)
from tests.engine.factory import cache_factory

Code = grpc.StatusCode


@pytest.fixture
def env(tmp_path):
    """``(pool, table, session)``."""
    with sessions(tmp_path) as (pool, table):
        yield pool, table, table.attach("t", "engine-0", LAYOUT, pool)


def test_write_then_read_round_trips_identical_bytes(env):
    pool, _, s = env
    seq = open_seq(s, list(range(100, 118)))  # 18 tokens: 4 full blocks and a partial one
    kv = kv_for(0, 18)
    written = write(s, [request(s, seq.id, 0, kv[:, :, :7]), request(s, seq.id, 7, kv[:, :, 7:])])
    assert written == 18
    got = read(s, seq.id, 0, 18)
    assert got.dtype == kv.dtype and got.shape == kv.shape
    assert got.numpy().tobytes() == kv.numpy().tobytes()
    torch.testing.assert_close(pool.read_kv(seq.id, 0, 18), kv, rtol=0, atol=0)  # in the pool
    torch.testing.assert_close(read(s, seq.id, 5, 6), kv[:, :, 5:11], rtol=0, atol=0)


def test_read_is_chunked_in_whole_tokens_under_max_bytes(env):
    _, _, s = env
    seq = open_seq(s, list(range(30)))
    write(s, [request(s, seq.id, 0, kv_for(0, 30))])
    per_token = kv_rpc.token_bytes(LAYOUT)  # 2 * 2 * 2 * 4 * 4 = 128
    max_bytes = kv_rpc.MESSAGE_OVERHEAD + 7 * per_token + 5  # room for 7 whole tokens
    replies = read_chunks(s, seq.id, 1, 29, max_bytes)
    assert [r.chunk.num_tokens for r in replies] == [7, 7, 7, 7, 1]
    assert [r.chunk.start for r in replies] == [1, 8, 15, 22, 29]
    assert all(r.ByteSize() <= max_bytes for r in replies)
    got = torch.cat([from_kv_chunk(r.chunk) for r in replies], dim=2)
    torch.testing.assert_close(got, kv_for(1, 29), rtol=0, atol=0)


def test_read_of_an_empty_range_is_one_empty_chunk(env):
    _, _, s = env
    seq = open_seq(s, list(range(5)))
    (reply,) = read_chunks(s, seq.id, 5, 0)
    assert reply.chunk.num_tokens == 0 and list(reply.chunk.shape) == [2, 2, 0, 2, 4]
    assert reply.chunk.data == b""


def test_read_of_committed_shared_blocks_is_allowed(env):
    pool, _, s = env
    seq = open_seq(s, list(range(9)))
    write(s, [request(s, seq.id, 0, kv_for(0, 9))])
    pool.commit(seq.id, "index").result()
    assert pool.sequence(seq.id).num_indexed == 2
    torch.testing.assert_close(read(s, seq.id, 0, 9), kv_for(0, 9), rtol=0, atol=0)


def test_read_refuses_a_message_limit_below_one_token(env):
    _, _, s = env
    seq = open_seq(s, list(range(5)))
    failure = refusal(lambda: read_chunks(s, seq.id, 0, 5, kv_rpc.MESSAGE_OVERHEAD + 100))
    assert failure.code is Code.RESOURCE_EXHAUSTED and "max_message_bytes" in failure.message


def test_read_refuses_a_range_past_the_end_and_foreign_sequences(env):
    pool, table, s = env
    seq = open_seq(s, list(range(5)))
    failure = refusal(lambda: read_chunks(s, seq.id, 3, 3))
    assert failure.code is Code.INVALID_ARGUMENT and "past the end" in failure.message
    other = table.attach("t", "engine-1", LAYOUT, pool)
    theirs = open_seq(other, list(range(50, 55)))
    failure = refusal(lambda: read_chunks(s, theirs.id, 0, 1))
    assert failure.code is Code.NOT_FOUND


def test_read_stream_ends_not_found_when_the_sequence_is_released_midway(env):
    """A reply stream is read lazily: a release between two chunks must not read slots that
    were freed (and may already hold another sequence's KV)."""
    pool, _, s = env
    seq = open_seq(s, list(range(20)))
    req = pb.ReadKVRequest(session_id=s.id, seq_id=seq.id, start=0, num_tokens=20)
    stream = kv_rpc.read_kv(s, req, kv_rpc.MESSAGE_OVERHEAD + 8 * kv_rpc.token_bytes(LAYOUT))
    next(stream)
    pool.release(seq.id)
    s.untrack(seq.id)
    failure = refusal(lambda: next(stream))
    assert failure.code is Code.NOT_FOUND


# -- WriteKV refusals: each leaves every pool byte, the sequences and the index as they were ---

def _not_owned(s, table, pool, seq):
    other = table.attach("t", "engine-1", LAYOUT, pool)
    theirs = open_seq(other, list(range(50, 58)))
    return [request(s, theirs.id, 0, kv_for(0, 8))]


def _unknown(s, table, pool, seq):
    return [request(s, 10_000, 0, kv_for(0, 1))]


def _committed(s, table, pool, seq):
    pool.commit(seq.id, "index").result()  # blocks 0, 1 indexed; 8..10 stay private
    return [request(s, seq.id, 6, kv_for(6, 4, seed=2))]


def _fork_tail(s, table, pool, seq):
    (child,) = pool.fork(seq.id, 1)  # indexes 0..8; the partial block 2 is shared by both
    s.track(child.id, len(child.block_table))
    return [request(s, child.id, 9, kv_for(9, 1, seed=2))]


def _bad_dtype(s, table, pool, seq):
    return [request(s, seq.id, 0, kv_for(0, 2).to(torch.float16))]


def _bad_shape(s, table, pool, seq):
    r = request(s, seq.id, 0, kv_for(0, 2))
    r.chunk.num_tokens = 3  # the shape says 2
    return [r]


def _bad_length(s, table, pool, seq):
    r = request(s, seq.id, 0, kv_for(0, 2))
    r.chunk.data = r.chunk.data[:-4]
    return [r]


def _past_end(s, table, pool, seq):
    return [request(s, seq.id, 8, kv_for(8, 3))]


def _other_session(s, table, pool, seq):
    r = request(s, seq.id, 0, kv_for(0, 2))
    r.session_id = s.id ^ 1
    return [r]


def _no_chunk(s, table, pool, seq):
    return [pb.WriteKVRequest(session_id=s.id)]


def _too_big(s, table, pool, seq):
    return [request(s, seq.id, 0, kv_for(0, 10))]  # 1,280 bytes over a 1 KiB limit below


@pytest.mark.parametrize("make,code,words", [
    (_not_owned, Code.NOT_FOUND, r"sequence \d+"),
    (_unknown, Code.NOT_FOUND, "sequence 10000"),
    (_committed, Code.FAILED_PRECONDITION, r"block 1, which is indexed.*only tokens 8\.\.10"),
    (_fork_tail, Code.FAILED_PRECONDITION, "shared with forked siblings"),
    (_bad_dtype, Code.INVALID_ARGUMENT, "dtype must be the layout's 'float32'"),
    (_bad_shape, Code.INVALID_ARGUMENT, r"shape must be .* \[2, 2, 3, 2, 4\]"),
    (_bad_length, Code.INVALID_ARGUMENT, "needs 256"),
    (_past_end, Code.INVALID_ARGUMENT, r"tokens 8\.\.11 are past the end .* Extend it first"),
    (_other_session, Code.INVALID_ARGUMENT, "must name session"),
    (_no_chunk, Code.INVALID_ARGUMENT, "must carry a chunk"),
    (_too_big, Code.RESOURCE_EXHAUSTED, "send at most 6 tokens per chunk"),
])
def test_write_refusals_change_nothing(env, make, code, words):
    pool, table, s = env
    seq = open_seq(s, list(range(10)))  # blocks 0, 1 full, block 2 partial
    write(s, [request(s, seq.id, 0, kv_for(0, 10))])
    reqs = make(s, table, pool, seq)
    assert_refused_unchanged(lambda: write(s, reqs, max_bytes=1024), pool, table, code, words)


def test_refused_chunk_keeps_earlier_chunks_and_says_how_many(env):
    pool, _, s = env
    seq = open_seq(s, list(range(10)))
    pool.commit(seq.id, "index").result()  # tokens 0..8 indexed
    good = request(s, seq.id, 8, kv_for(8, 2, seed=3))
    bad = request(s, seq.id, 4, kv_for(4, 2, seed=3))
    failure = refusal(lambda: write(s, [good, bad]))
    assert failure.code is Code.FAILED_PRECONDITION
    assert "2 tokens of this stream's earlier chunks were written" in failure.message
    torch.testing.assert_close(read(s, seq.id, 8, 2), kv_for(8, 2, seed=3), rtol=0, atol=0)


def test_write_stream_stops_when_the_session_ends_midway(env):
    """A stream outlives nothing: once its session ended, the next chunk is refused (its
    sequences were released and their slots may be another's)."""
    pool, table, s = env
    seq = open_seq(s, list(range(8)))

    def stream():
        yield request(s, seq.id, 0, kv_for(0, 4))
        table.end(s, "test")
        yield request(s, seq.id, 4, kv_for(4, 4))

    failure = refusal(lambda: write(s, stream()))
    assert failure.code is Code.NOT_FOUND and "ended" in failure.message
    pool.check_invariants()


def test_write_of_private_tail_after_fork_and_extend_is_allowed(env):
    """Extend copies the shared tail (copy-on-write): then it is the child's own to write."""
    pool, _, s = env
    seq = open_seq(s, list(range(10)))
    (child,) = pool.fork(seq.id, 1)
    s.track(child.id, len(child.block_table))
    pool.extend(child.id, [77])
    write(s, [request(s, child.id, 8, kv_for(8, 3, seed=4))])
    torch.testing.assert_close(read(s, child.id, 8, 3), kv_for(8, 3, seed=4), rtol=0, atol=0)


def test_kv_chunk_helpers_round_trip():
    kv = kv_for(3, 5)
    chunk = to_kv_chunk(9, 3, kv)
    assert (chunk.seq_id, chunk.start, chunk.num_tokens, chunk.dtype) == (9, 3, 5, "float32")
    torch.testing.assert_close(from_kv_chunk(chunk), kv, rtol=0, atol=0)


# -- pool descriptors (Attach) -----------------------------------------------------------------

def test_pool_descriptors_map_the_cpu_pools_byte_for_byte(env):
    """A client maps each descriptor's file at its offset with its shape, strides and dtype,
    and sees the very bytes the daemon wrote (no copy through the socket)."""
    pool, _, s = env
    seq = open_seq(s, list(range(10)))
    write(s, [request(s, seq.id, 0, kv_for(0, 10))])
    pool.commit(seq.id, "crash").result(timeout=30)  # write-through: the blocks reach HOST
    descs = pool_descriptors(pool)
    assert [d.tier for d in descs] == ["device", "host"]
    for d, tier in zip(descs, (0, 1)):
        tensor = pool.store.pool(tier).tensor
        assert list(d.shape) == list(tensor.shape) == list(LAYOUT.pool_shape(64))
        assert list(d.strides) == list(tensor.stride()) and d.dtype == "float32"
        assert d.file_id == pool.store.file_ids[tier] and not d.cuda_ipc
        mapped = np.memmap(d.path, dtype=np.float32, mode="r", offset=d.offset,
                           shape=tuple(d.shape))
        assert np.array_equal(mapped, tensor.numpy())
    device = np.memmap(descs[0].path, dtype=np.float32, mode="r", offset=descs[0].offset,
                       shape=tuple(descs[0].shape))
    got = np.stack([device[slot] for slot in pool.sequence(seq.id).block_table[:2]])
    want = kv_for(0, 8).unflatten(2, (2, BS)).permute(2, 0, 1, 3, 4, 5).numpy()
    assert np.array_equal(got, want)


def test_pool_descriptors_skip_an_absent_host_tier(tmp_path):
    with sessions(tmp_path, sizes=(8, 0, 8)) as (pool, _):
        assert [d.tier for d in pool_descriptors(pool)] == ["device"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_pool_is_described_by_its_ipc_handle(tmp_path):  # pragma: no cover - GPU
    from prefixd.api.tensors import load_cuda_ipc

    with cache_factory(tmp_path, LAYOUT, (8, 8, 0), use_cuda=True) as make:
        pool = make()
        device, host = pool_descriptors(pool)
        assert device.tier == "device" and device.path == "" and device.cuda_ipc
        assert device.cuda_device == pool.store.pool(0).tensor.device.index
        _, args = load_cuda_ipc(device.cuda_ipc)
        assert tuple(args[1]) == tuple(device.shape) == LAYOUT.pool_shape(8)
        assert host.path and not host.cuda_ipc
