"""Sessions and leases on a real daemon process: clients that die without Detach leak nothing.

Holders (``tests.daemon.lease_holders``: forked processes that attach, take sequences
and wait) are SIGKILLed; within the lease their sessions end and every sequence and pin they
held is released. "Released" is checked from the outside: ``Status`` counts the sessions, the
indexed blocks are exactly those before plus what the holders committed, and a probe ``Open``
of the whole device pool succeeds (one leaked pin or private block would make it
RESOURCE_EXHAUSTED), and the blocks committed are exactly those the holders' commits indexed
(a release must not index anything; Status' per-tier counts would not do: a committed block
also has a copy on the host).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest

from prefixd.api import prefixd_pb2 as pb
from tests.daemon.gsp_workload import BS, packed, pb_layout, systems, write_kv
from tests.daemon.harness import ROOT, DaemonProcess, start_daemon

DEVICE = 320
CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 60.0

[engine.blocks]
device = %d
host = 512
disk = 8192

[daemon]
lease_s = {lease_s}
""" % DEVICE
# NOTE: a holder without a stream lives on its calls' pings alone, so a host that stalls it for
# a whole lease between two calls ends its session before it is ready (CI, once, at 1.0 s)
SHORT_LEASE = 2.0
SLACK_S = 3.0  # past the lease: the sweep's tick, and a loaded 2-core machine
CYCLES, PER_CYCLE = 10, 20  # 200 holders killed, every mode in every cycle
MODES = ("private", "forked", "pinned", "private+keepalive", "forked+keepalive",
         "pinned+keepalive", "private+stalled", "forked+stalled")


class Spawner:
    """The fork server of holders (``lease_holders.spawner``) for daemon ``d``."""

    def __init__(self, d: DaemonProcess) -> None:
        self.out = os.path.join(d.base, "holders")
        os.makedirs(self.out, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.daemon.lease_holders", d.socket, self.out],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.n = 0
        self.pids: list[int] = []

    def spawn(self, mode: str, seed: int) -> tuple[str, int]:
        """A holder in ``mode``; returns ``(name, pid)`` once it holds its sequences."""
        self.n += 1
        name = f"h{self.n}"
        self.proc.stdin.write(f"{name} {mode} {seed}\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        self.pids.append(pid)
        return name, pid

    def ready(self, name: str, timeout: float = 60.0) -> dict:
        import json

        path = os.path.join(self.out, name)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path + ".ready"):
            if os.path.exists(path + ".failed"):
                with open(path + ".failed") as f:
                    raise AssertionError(f"holder {name} failed: {f.read()}")
            assert time.monotonic() < deadline, f"holder {name} not ready after {timeout} s"
            time.sleep(0.01)
        with open(path + ".ready") as f:
            return json.load(f)

    def kill(self, pid: int) -> None:
        """SIGKILL holder ``pid`` (if it still is one: the kernel reaps them, pids get reused)."""
        self.pids.remove(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tests.daemon.lease_holders" not in f.read():
                    return
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass

    def close(self) -> None:
        for pid in list(self.pids):  # holders a failed test left behind
            self.kill(pid)
        self.proc.stdin.close()
        self.proc.wait(30)


def status(d: DaemonProcess) -> tuple[int, int]:
    """(sessions, blocks ever committed) of the default tenant (Status, Stats)."""
    stub = d.stub()
    sessions = stub.Status(pb.StatusRequest(), timeout=30).sessions
    values = stub.Stats(pb.StatsRequest(), timeout=30).values
    return sessions, int(values["prefixd_committed_blocks_total"])


def wait_sessions(d: DaemonProcess, want: int, timeout: float) -> float:
    """Seconds until Status counts ``want`` sessions; fails after ``timeout``."""
    start = time.monotonic()
    while True:
        got = status(d)[0]
        if got == want:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, \
            f"{got} sessions, not {want}, {timeout} s on: a session outlived its lease"
        time.sleep(0.01)


def attach(stub) -> int:
    return stub.Attach(pb.AttachRequest(client_name="test", layout=pb_layout()), timeout=30).session_id


def probe_whole_device(d: DaemonProcess, seed: int) -> None:
    """Open (then release) a prompt of every device block: fails if any is pinned or private."""
    stub = d.stub()
    sid = attach(stub)
    rng = random.Random(seed)
    tokens = [rng.randrange(100000, 200000) for _ in range(DEVICE * BS)]
    try:
        seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)), timeout=30).sequence
    except grpc.RpcError as exc:
        raise AssertionError(f"the whole device pool cannot be opened: blocks leaked: "
                             f"{exc.code().name}: {exc.details()}") from None
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id), timeout=30)
    stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)


def commit_systems(d: DaemonProcess) -> None:
    """The shared system prefixes, committed (``pinned`` holders hit them)."""
    stub = d.stub()
    sid = attach(stub)
    for tokens in systems():
        seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)), timeout=30).sequence
        write_kv(stub, sid, seq.seq_id, tokens, seq.cached_tokens)
        stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True), timeout=30)
    stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)


@pytest.fixture(scope="module")
def short():
    """A daemon with a 1 s lease, the system prefixes committed, and a spawner of holders."""
    with start_daemon(CONFIG, lease_s=SHORT_LEASE) as d:
        commit_systems(d)
        spawner = Spawner(d)
        try:
            yield d, spawner
        finally:
            spawner.close()


@pytest.fixture(scope="module")
def long():
    """A daemon with a 30 s lease: what ends a session here ends it long before its lease."""
    with start_daemon(CONFIG, lease_s=30.0) as d:
        commit_systems(d)
        yield d


def test_clients_killed_without_detach_release_everything_within_the_lease(short, capsys):
    d, spawner = short
    base_sessions, base_blocks = status(d)
    probe_whole_device(d, 0)
    base_blocks = status(d)[1]
    rng = random.Random(11)
    worst, started = 0.0, time.monotonic()
    for cycle in range(CYCLES):
        holders = [spawner.spawn(MODES[(cycle * PER_CYCLE + i) % len(MODES)], rng.randrange(1 << 30))
                   for i in range(PER_CYCLE)]
        try:
            committed = sum(spawner.ready(name)["indexed"] for name, _ in holders)
            assert status(d) == (base_sessions + PER_CYCLE, base_blocks + committed)
        finally:  # a failure here must not leave live holders to the module's other tests
            for _, pid in holders:
                spawner.kill(pid)
        worst = max(worst, wait_sessions(d, base_sessions, SHORT_LEASE + SLACK_S))
        base_blocks += committed
        assert status(d) == (base_sessions, base_blocks), "a release at session end indexed blocks"
        if cycle % 3 == 2:
            probe_whole_device(d, cycle)
            assert status(d)[1] == base_blocks
    probe_whole_device(d, CYCLES)
    with capsys.disabled():
        print(f"\nleases: {CYCLES} cycles, {CYCLES * PER_CYCLE} holders killed, sessions gone "
              f"after at most {worst:.2f} s (lease {SHORT_LEASE} s), "
              f"{time.monotonic() - started:.0f} s")


@pytest.mark.parametrize("mode", ["pinned", "forked+stalled"])
def test_a_live_client_without_pings_loses_its_session_after_the_lease(short, mode):
    """No KeepAlive stream at all (ends one lease after its last call), or a stream open but
    silent (a stalled client): either way the session ends and its sequences are released
    while the process still lives."""
    d, spawner = short
    base = status(d)
    name, pid = spawner.spawn(mode, 5)
    committed = spawner.ready(name)["indexed"]
    try:
        wait_sessions(d, base[0], SHORT_LEASE + SLACK_S)
        os.kill(pid, 0)  # still alive: the lease, not the death of the client, ended it
    finally:
        spawner.kill(pid)
    assert status(d) == (base[0], base[1] + committed)
    probe_whole_device(d, 77)


def hold_some(stub, sid: int, rng: random.Random) -> int:
    """Private, forked and pinned sequences in session ``sid``; returns how many it holds."""
    unique = [rng.randrange(50000, 90000) for _ in range(3 * BS + 5)]
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(unique)), timeout=30).sequence
    write_kv(stub, sid, seq.seq_id, unique, 0)
    kids = stub.Fork(pb.ForkRequest(session_id=sid, seq_id=seq.seq_id, num_children=2),
                     timeout=30).children
    stub.Extend(pb.ExtendRequest(session_id=sid, seq_id=kids[0].seq_id, tokens=packed([7] * BS)),
                timeout=30)
    stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(systems()[2] + [1, 2, 3])), timeout=30)
    return 4


def test_a_keepalive_stream_closed_cleanly_ends_the_session_at_once(long):
    d = long
    base = status(d)
    stub = d.stub()
    sid = attach(stub)
    hold_some(stub, sid, random.Random(1))
    committed = status(d)[1]  # a fork indexes the parent's full blocks
    replies = list(stub.KeepAlive(iter([pb.KeepAliveRequest(session_id=sid)]), timeout=30))
    assert len(replies) == 1 and replies[0].lease_s == 30.0
    wait_sessions(d, base[0], 5.0)  # at once: the lease is 30 s
    assert status(d) == (base[0], committed)
    probe_whole_device(d, 1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(session_id=sid, tokens=packed([1])), timeout=30)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND


def test_detach_releases_every_sequence_of_the_session(long):
    d = long
    base = status(d)
    stub = d.stub()
    sid = attach(stub)
    held = hold_some(stub, sid, random.Random(2))
    sessions, committed = status(d)
    assert sessions == base[0] + 1
    reply = stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)
    assert reply.released_sequences == held
    assert status(d) == (base[0], committed)
    probe_whole_device(d, 2)


def test_a_client_that_cancels_its_commits_leaves_no_error_in_the_daemon_log(long):
    """Regression: the servicer awaited ``asyncio.wrap_future(ticket)``; a call cancelled
    while its ticket was pending (the client died or gave up) cancelled the engine's ticket,
    and the WAL's resolution of it then raised ``InvalidStateError`` on the committer thread
    ("exception calling callback" in the daemon's log). A cancelled call must leave the
    ticket alone (the commit still happens, the session still owns the sequence)."""
    d = long
    stub = d.stub()
    sid = attach(stub)
    rng = random.Random(3)
    seqs = []
    for _ in range(40):
        tokens = [rng.randrange(50000, 90000) for _ in range(2 * BS + 1)]
        seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)), timeout=30).sequence
        write_kv(stub, sid, seq.seq_id, tokens, 0)
        call = stub.Commit.future(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id,
                                                   durability="power"), timeout=30)
        time.sleep(rng.random() * 0.002)
        call.cancel()
        seqs.append((seq.seq_id, tokens))
    time.sleep(0.5)
    log = d.log()
    assert "InvalidStateError" not in log and "exception calling callback" not in log, log[-3000:]
    for seq_id, tokens in seqs:
        stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq_id), timeout=30)
    stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)


def test_a_second_daemon_on_the_same_state_exits_naming_the_first_and_the_first_serves(long):
    first = long
    second = DaemonProcess(CONFIG, lease_s=30.0)
    second.state_dir, second.socket = first.state_dir, first.socket  # same state AND socket
    second.expect_exit(1)  # refused: the state directory is locked by the first
    second.expect_log(r"^ERROR prefixd\.daemon: not starting: state directory lock .* is held by")
    try:
        second.start(wait=False)
        code = second.proc.wait(120)
        assert code != 0
        assert str(first.pid()) in second.log(), second.log()
    finally:
        second.close()
    reply = first.stub().Status(pb.StatusRequest(), timeout=30)
    assert reply.state == "serving" and reply.pid == first.pid()
    stub = first.stub()
    sid = attach(stub)  # the socket the second daemon did not touch still serves
    stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)


def test_sigterm_finishes_in_flight_commits_checkpoints_exits_0_and_the_restart_keeps_them():
    """24 commits in flight at SIGTERM: each is answered OK (and is a hit after the restart)
    or UNAVAILABLE (and did not happen); the daemon checkpoints and exits 0; a Reclaim after
    the restart returns every sequence of the session.

    CANCELLED would leave a client unable to tell whether its commit happened: gRPC core's
    server shutdown answers so the calls it read but had not handed to a handler, so the stop
    never shuts the servers down (server.py ``_shutdown``'s NOTE; 200 stops:
    tests/daemon/test_sigterm_drain.py)."""
    with start_daemon(CONFIG, lease_s=30.0) as d:
        stub = d.stub()
        sid = attach(stub)
        rng = random.Random(4)
        seqs = {}
        for _ in range(24):
            tokens = [rng.randrange(50000, 90000) for _ in range(3 * BS + 3)]
            seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)), timeout=30).sequence
            write_kv(stub, sid, seq.seq_id, tokens, 0)
            seqs[seq.seq_id] = tokens
        calls = {seq_id: stub.Commit.future(pb.CommitRequest(session_id=sid, seq_id=seq_id,
                                                             durability="power"), timeout=60)
                 for seq_id in seqs}
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0, d.log()
        done = []
        for seq_id, call in calls.items():
            try:
                call.result()
                done.append(seq_id)
            except grpc.RpcError as exc:  # not accepted before the stop: refused, not broken
                assert exc.code() is grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
        assert "checkpoint at stop" in d.log_text() and "stopped status=0" in d.log_text()
        d.start()
        stub = d.stub()
        new = attach(stub)
        for seq_id in done:
            cached = stub.Lookup(pb.LookupRequest(session_id=new, tokens=packed(seqs[seq_id])),
                                 timeout=30).cached_tokens
            assert cached == len(seqs[seq_id]) // BS * BS, "a commit answered before SIGTERM lost"
        back = stub.Reclaim(pb.ReclaimRequest(session_id=new, previous_session_id=sid),
                            timeout=30).sequences
        assert sorted(s.previous_seq_id for s in back) == sorted(seqs)
        for s in back:
            tokens = seqs[s.previous_seq_id]
            assert s.num_tokens == (len(tokens) // BS * BS if s.previous_seq_id in done else 0)
            assert bytes(s.tokens) == packed(tokens[:s.num_tokens])
