"""WriteKV, ReadKV and Attend through a real daemon process, with the raw generated stub, under
a small message limit (64 KiB) so that every stream spans several messages."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import DTYPES, from_kv_chunk, from_tensor_msg, to_kv_chunk, to_tensor_msg
from prefixd.kernels.reference import paged_decode_reference
from tests.daemon.harness import DEFAULT_CONFIG, start_daemon

LIMIT = 1 << 16
CONFIG = DEFAULT_CONFIG + f"max_message_bytes = {LIMIT}\n"
LAYOUT = pb.KVLayout(model_id="kv-e2e", num_layers=4, num_kv_heads=2, head_dim=64,
                     dtype="float16", block_size=16)
PER_TOKEN = 4 * 2 * 2 * 64 * 2  # bytes of one token's KV
CHUNK = 24  # tokens per WriteKV message: 48 KiB, under the limit


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(CONFIG, lease_s=60.0) as d:  # no KeepAlive stream in these tests
        yield d


@pytest.fixture
def conn(daemon):
    """``(stub, session_id)``; detached after the test."""
    stub = daemon.stub()
    reply = stub.Attach(pb.AttachRequest(client_name="kv-e2e", layout=LAYOUT))
    assert reply.max_message_bytes == LIMIT
    yield stub, reply.session_id
    try:
        stub.Detach(pb.DetachRequest(session_id=reply.session_id))
    except grpc.RpcError:
        pass


def open_seq(stub, sid, first, n):
    tokens = np.arange(first, first + n, dtype="<i4").tobytes()
    return stub.Open(pb.OpenRequest(session_id=sid, tokens=tokens)).sequence


def random_kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((4, 2, n, 2, 64), generator=g).to(torch.float16)


def chunk_request(sid, seq_id, start, kv):
    req = pb.WriteKVRequest(session_id=sid)
    to_kv_chunk(seq_id, start, kv, out=req.chunk)
    return req


def write(stub, sid, seq_id, start, kv):
    reqs = [chunk_request(sid, seq_id, start + i, kv[:, :, i:i + CHUNK])
            for i in range(0, kv.shape[2], CHUNK)]
    return stub.WriteKV(iter(reqs)).written_tokens


def read(stub, sid, seq_id, start, n):
    replies = list(stub.ReadKV(pb.ReadKVRequest(session_id=sid, seq_id=seq_id, start=start, num_tokens=n)))
    assert all(r.ByteSize() <= LIMIT for r in replies)
    return replies, torch.cat([from_kv_chunk(r.chunk) for r in replies], dim=2)


def test_kv_written_in_chunks_reads_back_identical_across_messages_and_after_a_hit(conn):
    stub, sid = conn
    seq = open_seq(stub, sid, 5000, 100)
    kv = random_kv(100, seed=1)
    assert write(stub, sid, seq.seq_id, 0, kv) == 100
    replies, got = read(stub, sid, seq.seq_id, 0, 100)
    assert len(replies) == -(-100 // ((LIMIT - 256) // PER_TOKEN))  # several messages
    assert got.numpy().tobytes() == kv.numpy().tobytes()
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True, durability="crash"))
    again = open_seq(stub, sid, 5000, 100)
    assert again.cached_tokens == 96  # six committed blocks served from the cache
    _, hit = read(stub, sid, again.seq_id, 0, 96)
    assert hit.numpy().tobytes() == kv[:, :, :96].numpy().tobytes()


def test_writekv_into_a_committed_block_is_refused_and_changes_nothing(conn):
    stub, sid = conn
    seq = open_seq(stub, sid, 7000, 40)
    kv = random_kv(40, seed=2)
    write(stub, sid, seq.seq_id, 0, kv)
    stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id, durability="crash"))
    with pytest.raises(grpc.RpcError) as err:
        write(stub, sid, seq.seq_id, 10, random_kv(4, seed=3))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "indexed" in err.value.details()
    _, got = read(stub, sid, seq.seq_id, 0, 40)
    assert got.numpy().tobytes() == kv.numpy().tobytes()


def test_a_chunk_over_the_message_limit_is_resource_exhausted(conn):
    stub, sid = conn
    seq = open_seq(stub, sid, 9000, 40)
    big = chunk_request(sid, seq.seq_id, 0, random_kv(40, seed=4))
    with pytest.raises(grpc.RpcError) as err:
        stub.WriteKV(iter([big]))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_attend_decode_equals_the_reference_over_the_kv_written(conn):
    stub, sid = conn
    seqs = [open_seq(stub, sid, 11000 + 1000 * i, n) for i, n in enumerate((33, 20))]
    kvs = [random_kv(s.num_tokens, seed=10 + i) for i, s in enumerate(seqs)]
    for s, kv in zip(seqs, kvs):
        write(stub, sid, s.seq_id, 0, kv)
    q = torch.randn((2, 4, 64)).to(torch.float16)
    reply = stub.Attend(pb.AttendRequest(session_id=sid, seq_ids=[s.seq_id for s in seqs], layer=2,
                                         query=to_tensor_msg(q)))
    out = from_tensor_msg(reply.output)
    # the same call over a local pool holding the same KV in the same layout
    pool = torch.zeros((8, 4, 2, 16, 2, 64), dtype=torch.float16)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    for row, kv in zip(tables.tolist(), kvs):
        n = kv.shape[2]
        for b in range(-(-n // 16)):
            k = min(16, n - 16 * b)
            pool[row[b], :, :, :k] = kv[:, :, 16 * b:16 * b + k]
    want = paged_decode_reference(q, pool[:, 2, 0], pool[:, 2, 1], tables,
                                  torch.tensor([33, 20], dtype=torch.int32))
    torch.testing.assert_close(out, want)
    with pytest.raises(grpc.RpcError) as err:
        stub.Attend(pb.AttendRequest(session_id=sid, seq_ids=[seqs[0].seq_id], layer=4,
                                     query=to_tensor_msg(q[:1])))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_client_library_round_trips_every_dtype_bit_for_bit_over_chunked_rpcs(daemon, dtype):
    """The KV bytes skip protobuf both ways (``prefixd.api.kv_frames``): WriteKV requests the
    client frames and the daemon decodes as frames, ReadKV replies gathered through the
    daemon's staging buffer and decoded as frames by the client. Every bit pattern of every
    dtype comes back, across several messages each way and partial blocks at both ends."""
    import prefixd.client as pc

    layout = pc.KVLayout(f"kv-frames-{dtype}", num_layers=2, num_kv_heads=2, head_dim=16,
                         dtype=dtype, block_size=16)
    itemsize = getattr(torch, dtype).itemsize
    n = 70_000 // (2 * 2 * 2 * 16 * itemsize) + 40  # past one 64 KiB message of KV each way
    g = torch.Generator().manual_seed(len(dtype))
    x = torch.randint(0, 256, (2, 2, n, 2, 16 * itemsize), dtype=torch.uint8, generator=g)
    with pc.connect(daemon.socket, layout, name="kv-frames", mapped=False) as s:
        assert s.max_message_bytes == LIMIT
        seq = s.open(list(range(9000, 9000 + n + 20)))
        s.write_kv(seq, 3, x.view(getattr(torch, dtype)))
        got = s.read_kv(seq, 3, n)
        assert got.dtype == getattr(torch, dtype)
        assert torch.equal(got.view(torch.uint8), x)
        s.release(seq)
