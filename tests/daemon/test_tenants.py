"""Two tenants on one daemon: one socket each, and identical prompts never
hit, show or count across them; the same prompts on one tenant do hit (the positive control).
Also the sockets' modes from ``[[daemon.sockets]]`` and the 0750 directory the daemon makes."""

from __future__ import annotations

import json
import os
import stat

import grpc
import numpy as np
import pytest

from prefixd.api import prefixd_pb2 as pb
from tests.daemon.harness import start_daemon, two_tenant_config

Code = grpc.StatusCode
BS = 4
LAYOUT = pb.KVLayout(model_id="tenant-test", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=BS)

# alpha: its socket listed with a mode; beta: not listed, so <socket dir>/beta.sock, mode 0660.
CONFIG = two_tenant_config(device=128, host=256, disk=512, tables="""
[[daemon.sockets]]
tenant = "alpha"
path = "{base}/run/s.sock"
mode = "0640"
""")

PROMPTS = [np.arange(1000 * i, 1000 * i + 37, dtype="<i4").tobytes() for i in range(1, 4)]
FULL = 36  # 37 tokens: 9 full blocks of 4


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(CONFIG) as d:
        yield d


def beta_socket(d) -> str:
    return os.path.join(os.path.dirname(d.socket), "beta.sock")


@pytest.fixture(scope="module")
def stubs(daemon):
    """``{"alpha": stub, "beta": stub}``, one channel per tenant socket."""
    return {"alpha": daemon.stub(daemon.socket), "beta": daemon.stub(beta_socket(daemon))}


def attach(stub) -> int:
    return stub.Attach(pb.AttachRequest(client_name="tenant-test", layout=LAYOUT)).session_id


def stats(stub) -> dict[str, float]:
    return dict(stub.Stats(pb.StatsRequest()).values)


def open_commit_release(stub, sid: int, prompt: bytes) -> pb.SequenceReply:
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=prompt)).sequence
    stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id))
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))
    return seq


def code_of(call, request) -> Code:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    return err.value.code()


def test_identical_prompts_never_hit_across_tenants_but_hit_within_one(stubs):
    a, b = stubs["alpha"], stubs["beta"]
    sa, sb = attach(a), attach(b)
    for prompt in PROMPTS:
        first = open_commit_release(a, sa, prompt)
        assert first.cached_tokens == 0
    # positive control: the same prompts again on alpha hit in full
    for prompt in PROMPTS:
        assert a.Lookup(pb.LookupRequest(session_id=sa, tokens=prompt)).cached_tokens == FULL
        again = open_commit_release(a, sa, prompt)
        assert again.cached_tokens == FULL and again.num_indexed == FULL // BS
    a_stats = stats(a)
    assert a_stats["prefixd_committed_blocks_total"] == len(PROMPTS) * FULL // BS
    assert a_stats["prefixd_hit_tokens_total"] == len(PROMPTS) * FULL

    # beta: identical prompts, nothing of alpha's found, shown or counted
    for prompt in PROMPTS:
        look = b.Lookup(pb.LookupRequest(session_id=sb, tokens=prompt))
        assert (look.cached_tokens, look.device_tokens, look.host_tokens, look.disk_tokens,
                look.unverified_tokens) == (0, 0, 0, 0, 0)
    b_stats = stats(b)
    assert b_stats.get("prefixd_committed_blocks_total", 0) == 0
    assert b_stats.get("prefixd_hit_tokens_total", 0) == 0
    assert all(v == 0 for k, v in b_stats.items() if k.startswith("prefixd_blocks{"))
    doc = json.loads(b.Stats(pb.StatsRequest(session_id=sb)).json)
    assert doc["tenant"] == "beta"
    assert all(p["cache"]["committed_blocks"] == 0 for p in doc["pools"].values())
    status = b.Status(pb.StatusRequest())
    assert status.tenant == "beta" and status.sessions == 1
    assert [p.tenant for p in status.pools] == ["beta"]  # its own (empty) pool only
    assert list(status.pools[0].blocks) == [0, 0, 0]

    for prompt in PROMPTS:  # beta's own open misses, then beta's own commit counts for beta only
        seq = open_commit_release(b, sb, prompt)
        assert seq.cached_tokens == 0 and seq.num_indexed == 0
    assert stats(b)["prefixd_committed_blocks_total"] == len(PROMPTS) * FULL // BS
    assert stats(b)["prefixd_hit_tokens_total"] == 0
    assert stats(a)["prefixd_committed_blocks_total"] == a_stats["prefixd_committed_blocks_total"]
    assert stats(a)["prefixd_hit_tokens_total"] == a_stats["prefixd_hit_tokens_total"]
    a_status = a.Status(pb.StatusRequest())
    assert a_status.tenant == "alpha" and [p.tenant for p in a_status.pools] == ["alpha"]
    for stub, sid in ((a, sa), (b, sb)):
        stub.Detach(pb.DetachRequest(session_id=sid))


def test_a_session_of_one_tenant_is_not_found_on_the_other(stubs):
    """The other tenant's socket answers a session id exactly like an unknown one: NOT_FOUND,
    whatever the rpc, both ways; and a sequence id of the other tenant is not found either."""
    a, b = stubs["alpha"], stubs["beta"]
    sa, sb = attach(a), attach(b)
    seq_a = a.Open(pb.OpenRequest(session_id=sa, tokens=PROMPTS[0])).sequence.seq_id
    seq_b = b.Open(pb.OpenRequest(session_id=sb, tokens=PROMPTS[0])).sequence.seq_id
    for theirs, sid, seq, mine, my_sid in ((b, sa, seq_a, a, sa), (a, sb, seq_b, b, sb)):
        calls = [
            (theirs.Lookup, pb.LookupRequest(session_id=sid, tokens=PROMPTS[0])),
            (theirs.Open, pb.OpenRequest(session_id=sid, tokens=PROMPTS[0])),
            (theirs.Extend, pb.ExtendRequest(session_id=sid, seq_id=seq, tokens=PROMPTS[1])),
            (theirs.Commit, pb.CommitRequest(session_id=sid, seq_id=seq)),
            (theirs.Fork, pb.ForkRequest(session_id=sid, seq_id=seq, num_children=1)),
            (theirs.Release, pb.ReleaseRequest(session_id=sid, seq_id=seq, commit=True)),
            (theirs.Reclaim, pb.ReclaimRequest(session_id=sid, previous_session_id=12345)),
            (theirs.Stats, pb.StatsRequest(session_id=sid)),
            (theirs.Detach, pb.DetachRequest(session_id=sid)),
            (theirs.Attend, pb.AttendRequest(session_id=sid, seq_ids=[seq])),
            (lambda r: list(theirs.ReadKV(r)), pb.ReadKVRequest(session_id=sid, seq_id=seq)),
            (lambda r: list(theirs.KeepAlive(iter([r]))), pb.KeepAliveRequest(session_id=sid)),
        ]
        for call, request in calls:
            assert code_of(call, request) == Code.NOT_FOUND, request
        # the other tenant's own session cannot name this tenant's sequence
        other_sid = sb if theirs is b else sa
        assert code_of(theirs.Commit, pb.CommitRequest(session_id=other_sid, seq_id=seq)) \
            == Code.NOT_FOUND
        # nothing above touched the session or its sequence on its own socket
        reply = mine.Commit(pb.CommitRequest(session_id=my_sid, seq_id=seq))
        assert reply.sequence.seq_id == seq
    assert a.Detach(pb.DetachRequest(session_id=sa)).released_sequences == 1
    assert b.Detach(pb.DetachRequest(session_id=sb)).released_sequences == 1


def test_tenant_sockets_get_their_modes_in_a_0750_directory(daemon):
    """alpha's socket has the mode of its ``[[daemon.sockets]]`` entry; beta, not listed, sits
    beside it with the default 0660; the daemon made the directory 0750."""
    run_dir = os.path.dirname(daemon.socket)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o750
    alpha, beta = os.stat(daemon.socket), os.stat(beta_socket(daemon))
    assert stat.S_ISSOCK(alpha.st_mode) and stat.S_ISSOCK(beta.st_mode)
    assert stat.S_IMODE(alpha.st_mode) == 0o640
    assert stat.S_IMODE(beta.st_mode) == 0o660
