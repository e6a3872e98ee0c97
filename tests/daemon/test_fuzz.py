"""Fuzzing a real daemon: drawn calls of every rpc (unknown, stale, zero and huge ids; empty,
ragged, huge and oversized tokens; bad layouts, shapes, dtypes, durability strings, fork
counts), random bytes on the raw socket, and clients that vanish mid-call (a channel closed
under a call in flight, a client process SIGKILLed while it holds a KeepAlive stream and
sequences) -- all against one daemon process that stays up.

What must hold: every reply is OK or a status a client can act on (``fuzz_ops.ALLOWED``:
never INTERNAL or UNKNOWN), the daemon lives, its RSS (less the free bytes its malloc heap keeps:
the NOTE at ``fuzz_run.RSS_SLACK_KB``) and open fds stay flat after a warm-up,
and the index holds exactly what the valid calls put there (refused calls changed nothing);
once every fuzz session is detached nothing is pinned: the whole device pool can be opened
anew, and a committed prompt still hits. The daemon then restarts cleanly.

The calls are drawn by one description (``fuzz_draw.op``) from two sources: a fifth by
hypothesis (``st.data()``, ``derandomize=True`` in ``make test``: the same calls every run;
a failure shrinks to a short list of calls), the rest by a seeded ``random.Random`` (drawing
through hypothesis costs ~10 ms a call on the loaded 2-core host, more than the call). The soak
variant makes 10x the calls, with a new seed (printed) and new hypothesis draws.

The parts: ``fuzz_draw`` (what one call is), ``fuzz_ops`` (the ``Fuzzer``: makes the calls,
checks every answer and keeps the model of the index), ``fuzz_vanishing_clients`` (raw bytes,
closed channels, killed client processes) and ``fuzz_run`` (one run: the steps, the schedule of
samples and kills, the bounds that say "flat"). This module holds the daemon and what is
checked at the end of a run.
"""

from __future__ import annotations

import os
import random

import grpc
import numpy as np
import pytest

from prefixd.api import prefixd_pb2 as pb
from tests.daemon import fuzz_draw
from tests.daemon.fuzz_draw import BASE, BS, LAYOUT
from tests.daemon.fuzz_ops import layout_key
from tests.daemon.fuzz_run import CALLS, Run
from tests.daemon.harness import start_daemon

DEVICE_BLOCKS = 1024
CONFIG = f"""
[engine]
sync = "commit"
shm_dir = "{{shm}}"
reclaim_grace_s = 3600.0

[engine.blocks]
device = {DEVICE_BLOCKS}
host = 4096
disk = 16384

[[engine.tenants]]
name = "default"

[[engine.tenants]]
name = "other"
salt = "other"

[daemon]
lease_s = {{lease_s}}
max_message_bytes = {fuzz_draw.MAX_MESSAGE}

[daemon.events]
ring_size = 1024

[daemon.limits]
sequences_per_session = 64
pools_per_tenant = {fuzz_draw.POOLS_PER_TENANT}
"""


@pytest.fixture(scope="module")
def daemon():
    """A daemon whose state already holds committed prompts and the sequences of two sessions
    of before a restart (``d.previous``: stale ids, and Reclaim's)."""
    with start_daemon(CONFIG, lease_s=600.0) as d:
        stub = d.stub()
        previous = []
        for i in range(2):
            sid = stub.Attach(pb.AttachRequest(client_name="before", layout=LAYOUT)).session_id
            seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=BASE[i].tobytes())).sequence
            stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id))
            stub.Open(pb.OpenRequest(session_id=sid, tokens=BASE[i][:50].tobytes()))
            previous.append(sid)
        d.restart()
        d.previous = previous
        d.indexed = {layout_key(LAYOUT): {BASE[i][:k * BS].tobytes() for i in range(2)
                                          for k in range(1, 96 // BS + 1)}}
        yield d


def check_nothing_leaked(d, run: Run) -> None:
    """Detach every fuzz session; then the index holds what the valid calls made and no block
    is pinned: the whole device pool opens anew, and a committed prompt hits in full."""
    f = run.fuzzer
    for held in list(f.live):
        f.detach(held)
    for sid in f.other_ids:
        f.call("Detach", f.other.Detach, pb.DetachRequest(session_id=sid))
    stub = d.stub()
    status = stub.Status(pb.StatusRequest())
    assert status.sessions == 0, status
    values = stub.Stats(pb.StatsRequest()).values
    initial = sum(len(v) for v in d.indexed.values())
    made = sum(len(v) for v in f.indexed.values()) - initial
    assert values["prefixd_committed_blocks_total"] - run.committed0 == made, (made, run.committed0, values)
    sid = stub.Attach(pb.AttachRequest(client_name="after", layout=LAYOUT)).session_id
    for prev in d.previous:  # what the fuzz did not reclaim, reclaimed and let go
        for item in stub.Reclaim(pb.ReclaimRequest(session_id=sid,
                                                   previous_session_id=prev)).sequences:
            if item.seq_id:
                stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=item.seq_id))
    whole = np.arange(900_000, 900_000 + DEVICE_BLOCKS * BS, dtype="<i4").tobytes()
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=whole)).sequence
    assert seq.num_tokens == DEVICE_BLOCKS * BS
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=BASE[0].tobytes())).sequence
    assert seq.cached_tokens == 96 - BS  # a full hit leaves the last block to compute
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))
    stub.Detach(pb.DetachRequest(session_id=sid))


def fuzz_and_check(d, target: int, *, derandomize: bool, seed: int) -> None:
    run = Run(d, target)
    try:
        run.go(derandomize=derandomize, seed=seed)
    finally:
        print(f"fuzz: seed={seed}", run.report())
    assert run.total >= target and len(run.samples) >= 4
    assert run.kills >= 1 and run.raw and run.fuzzer.calls["vanish"]
    assert all(run.fuzzer.calls[name] for name in fuzz_draw.OPS), run.fuzzer.calls
    check_nothing_leaked(d, run)
    # the next run on this module's daemon (both, in one pytest session) starts from this
    # index: without it that run's model expected blocks this one had indexed already
    d.indexed = {k: set(v) for k, v in run.fuzzer.indexed.items()}


def test_fuzz_every_rpc_raw_bytes_and_vanishing_clients(daemon):
    fuzz_and_check(daemon, CALLS, derandomize=True, seed=11)


@pytest.mark.soak
def test_fuzz_soak(daemon):
    fuzz_and_check(daemon, 10 * CALLS, derandomize=False, seed=random.randrange(1 << 32))


def test_an_attach_too_big_for_its_pool_is_refused_and_leaves_no_pool(daemon):
    """Bug: an Attach whose layout is valid but whose pool files cannot fit was answered
    DATA_LOSS ("the daemon can no longer make this pool durable") and left the new pool's
    manifest behind, so the daemon's next start failed opening that pool ("not starting")."""
    stub = daemon.stub()
    before = [p.model_id for p in stub.Status(pb.StatusRequest()).pools]
    for lay in fuzz_draw.HUGE_LAYOUTS:
        with pytest.raises(grpc.RpcError) as err:
            stub.Attach(pb.AttachRequest(client_name="huge", layout=lay))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert lay.model_id in err.value.details()
    assert [p.model_id for p in stub.Status(pb.StatusRequest()).pools] == before
    pools_dir = os.path.join(daemon.state_dir, "pools", "default")
    names = [lay.model_id for lay in fuzz_draw.HUGE_LAYOUTS]
    assert not [n for n in os.listdir(pools_dir) if n.split("-")[0] in names]


def test_a_tenant_gets_at_most_pools_per_tenant_pools(daemon):
    """Bug: every new layout attached with made a pool (files, a log, opened at every start)
    without bound; past ``[daemon.limits] pools_per_tenant`` Attach is RESOURCE_EXHAUSTED,
    and the layouts of existing pools still attach."""
    stub = daemon.stub()
    pools_dir = os.path.join(daemon.state_dir, "pools", "default")

    def on_disk() -> int:  # open or closed while empty (the tick closes them): each counts
        return sum(os.path.exists(os.path.join(pools_dir, n, "pool.json"))
                   for n in os.listdir(pools_dir))

    made = on_disk()
    codes = []
    for i in range(fuzz_draw.POOLS_PER_TENANT + 1):
        lay = pb.KVLayout(model_id=f"limit-{i}", num_layers=1, num_kv_heads=1, head_dim=2,
                          dtype="float16", block_size=2)
        try:
            sid = stub.Attach(pb.AttachRequest(client_name="limit", layout=lay)).session_id
            stub.Detach(pb.DetachRequest(session_id=sid))
            codes.append("OK")
        except grpc.RpcError as err:
            codes.append(err.code().name)
    room = fuzz_draw.POOLS_PER_TENANT - made
    assert codes == ["OK"] * room + ["RESOURCE_EXHAUSTED"] * (len(codes) - room)
    assert on_disk() == fuzz_draw.POOLS_PER_TENANT
    sid = stub.Attach(pb.AttachRequest(client_name="again", layout=LAYOUT)).session_id
    stub.Detach(pb.DetachRequest(session_id=sid))


def test_daemon_restarts_after_the_fuzz(daemon):
    """After all of the above the daemon stops cleanly and starts again on its state (a
    refused Attach must not leave a pool behind that the next start cannot open), and ids of
    before the restart are NOT_FOUND."""
    assert daemon.stop() == 0, daemon.log()
    daemon.start()
    stub = daemon.stub()
    assert stub.Status(pb.StatusRequest()).state == "serving"
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(session_id=daemon.previous[0], tokens=BASE[0].tobytes()))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
