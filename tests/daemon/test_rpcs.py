"""Every control rpc through a real daemon process, with raw generated stubs: what each
returns, and that a refused call is a status a person can act on and changes nothing."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from prefixd.api import prefixd_pb2 as pb
from tests.daemon.harness import start_daemon

LAYOUT = pb.KVLayout(model_id="tiny", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=16)


def toks(*ranges) -> bytes:
    return np.concatenate([np.arange(a, b, dtype="<i4") for a, b in ranges]).tobytes()


def table(seq) -> list[int]:
    return np.frombuffer(seq.block_table, "<i4").tolist()


@pytest.fixture(scope="module")
def daemon():
    with start_daemon() as d:
        yield d


@pytest.fixture
def stub(daemon):
    return daemon.stub()


@pytest.fixture
def sid(stub):
    reply = stub.Attach(pb.AttachRequest(client_name="rpc-test", layout=LAYOUT))
    yield reply.session_id
    try:
        stub.Detach(pb.DetachRequest(session_id=reply.session_id))
    except grpc.RpcError:
        pass


def code_of(call, *args) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    assert err.value.details(), "a refusal must say why"
    return err.value.code()


def test_attach_returns_a_session_a_lease_and_mappable_pools(stub):
    reply = stub.Attach(pb.AttachRequest(client_name="a", layout=LAYOUT))
    assert reply.session_id and reply.lease_s > 0 and reply.tenant == "default"
    tiers = {p.tier: p for p in reply.pools}
    assert "device" in tiers
    dev = tiers["device"]
    assert dev.path and list(dev.shape)[1:] == [1, 2, 16, 1, 8] and dev.dtype == "float16"
    stub.Detach(pb.DetachRequest(session_id=reply.session_id))


def test_a_bad_layout_is_invalid_argument(stub):
    bad = pb.KVLayout(model_id="m", num_layers=0, num_kv_heads=1, head_dim=8, dtype="float16",
                      block_size=16)
    assert code_of(stub.Attach, pb.AttachRequest(layout=bad)) == grpc.StatusCode.INVALID_ARGUMENT
    odd = pb.KVLayout(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="int3",
                      block_size=16)
    assert code_of(stub.Attach, pb.AttachRequest(layout=odd)) == grpc.StatusCode.INVALID_ARGUMENT


def test_open_commit_release_then_lookup_and_open_hit(stub, sid):
    prompt = toks((1000, 1100))  # 100 tokens: 6 full blocks
    before = stub.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt))
    assert before.cached_tokens == 0
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=prompt)).sequence
    assert seq.num_tokens == 100 and seq.cached_tokens == 0 and len(table(seq)) == 7
    reply = stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id, durability="crash"))
    assert reply.indexed_blocks == 6 and reply.sequence.num_indexed == 6
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))
    after = stub.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt))
    assert after.cached_tokens == 96 and after.device_tokens == 96
    again = stub.Open(pb.OpenRequest(session_id=sid, tokens=prompt)).sequence
    assert again.cached_tokens == 96 and table(again)[:6] == table(reply.sequence)[:6]
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=again.seq_id))


def test_extend_grows_the_table_and_release_with_commit_indexes(stub, sid):
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=toks((2000, 2010)))).sequence
    grown = stub.Extend(pb.ExtendRequest(session_id=sid, seq_id=seq.seq_id,
                                         tokens=toks((2010, 2040)))).sequence
    assert grown.num_tokens == 40 and len(table(grown)) == 3 and table(grown)[0] == table(seq)[0]
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True,
                                   durability="power"))
    assert stub.Lookup(pb.LookupRequest(session_id=sid, tokens=toks((2000, 2040)))).cached_tokens == 32


def test_fork_shares_blocks_and_copies_the_partial_tail_on_write(stub, sid):
    parent = stub.Open(pb.OpenRequest(session_id=sid, tokens=toks((3000, 3020)))).sequence
    children = stub.Fork(pb.ForkRequest(session_id=sid, seq_id=parent.seq_id, num_children=2)).children
    assert len(children) == 2
    for child in children:
        assert table(child) == table(parent) and child.num_tokens == 20
    # the partial last block is shared: extending a child copies it first
    child = stub.Extend(pb.ExtendRequest(session_id=sid, seq_id=children[0].seq_id,
                                         tokens=toks((9, 10)))).sequence
    assert table(child)[0] == table(parent)[0]  # the committed full block stays shared
    assert table(child)[1] != table(parent)[1]  # copy-on-write of the shared tail
    for s in (parent, *children):
        stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=s.seq_id))


def test_refusals_are_statuses_that_change_nothing(stub, sid):
    C = grpc.StatusCode
    status0 = stub.Status(pb.StatusRequest())
    assert code_of(stub.Open, pb.OpenRequest(session_id=sid, tokens=b"abc")) == C.INVALID_ARGUMENT
    assert code_of(stub.Open, pb.OpenRequest(session_id=sid, tokens=b"")) == C.INVALID_ARGUMENT
    assert code_of(stub.Open, pb.OpenRequest(session_id=sid + 1, tokens=toks((0, 4)))) == C.NOT_FOUND
    assert code_of(stub.Extend, pb.ExtendRequest(session_id=sid, seq_id=987654)) == C.NOT_FOUND
    assert code_of(stub.Commit, pb.CommitRequest(session_id=sid, seq_id=987654)) == C.NOT_FOUND
    assert code_of(stub.Release, pb.ReleaseRequest(session_id=sid, seq_id=987654)) == C.NOT_FOUND
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=toks((4000, 4017)))).sequence
    assert code_of(stub.Commit, pb.CommitRequest(session_id=sid, seq_id=seq.seq_id,
                                                 durability="forever")) == C.INVALID_ARGUMENT
    assert code_of(stub.Fork, pb.ForkRequest(session_id=sid, seq_id=seq.seq_id,
                                             num_children=0)) == C.INVALID_ARGUMENT
    huge = toks((0, 300 * 16))  # more blocks than the device pool (256) holds
    assert code_of(stub.Open, pb.OpenRequest(session_id=sid, tokens=huge)) == C.RESOURCE_EXHAUSTED
    assert code_of(stub.Reclaim, pb.ReclaimRequest(session_id=sid)) == C.INVALID_ARGUMENT
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))
    status1 = stub.Status(pb.StatusRequest())
    # device-tier index only: earlier tests' blocks may still be spilling to disk meanwhile
    assert [p.blocks[0] for p in status1.pools] == [p.blocks[0] for p in status0.pools]
    assert status1.sessions == status0.sessions


def test_another_sessions_sequence_is_not_found(stub, sid):
    other = stub.Attach(pb.AttachRequest(client_name="other", layout=LAYOUT)).session_id
    seq = stub.Open(pb.OpenRequest(session_id=other, tokens=toks((5000, 5005)))).sequence
    for call, req in ((stub.Extend, pb.ExtendRequest(session_id=sid, seq_id=seq.seq_id)),
                      (stub.Commit, pb.CommitRequest(session_id=sid, seq_id=seq.seq_id)),
                      (stub.Release, pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))):
        assert code_of(call, req) == grpc.StatusCode.NOT_FOUND
    assert stub.Detach(pb.DetachRequest(session_id=other)).released_sequences == 1
    assert code_of(stub.Detach, pb.DetachRequest(session_id=other)) == grpc.StatusCode.NOT_FOUND


def test_stats_status_and_checkpoint(stub, sid):
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=toks((6000, 6033)))).sequence
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True))
    stats = stub.Stats(pb.StatsRequest(session_id=sid))
    assert stats.values["prefixd_opens_total"] >= 1
    assert stats.values['prefixd_rpc_calls_total{method="Open"}'] >= 1
    status = stub.Status(pb.StatusRequest())
    assert status.state == "serving" and status.pid > 0 and status.tenant == "default"
    pool = [p for p in status.pools if p.model_id == "tiny"][0]
    assert pool.layout.head_dim == 8 and pool.capacity[0] == 256 and pool.blocks[0] >= 2
    assert stub.Checkpoint(pb.CheckpointRequest()).pools >= 1


def test_subscribe_events_checks_the_session(stub, sid):
    """Served since issue 15 (tests/daemon/test_events.py); an unknown session is NOT_FOUND
    like every other rpc's."""
    stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(session_id=sid ^ 1), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stream))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
