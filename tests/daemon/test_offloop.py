"""The daemon's long work runs beside its event loop (``prefixd.daemon.offloop``), on a real
daemon process: an Attach whose pool takes seconds to make answers within its deadline and
leaves no session behind, and a checkpoint of a large pool lets other clients' calls through.

Timing on a loaded 2-core host is asserted loosely, by what a held loop cannot do (answer a
call while the checkpoint or the make runs); the strict loop-lag figure is a benchmark's."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

import grpc
import pytest

import prefixd.client as pc
from prefixd.api import prefixd_pb2 as pb
from tests.daemon.gsp_workload import packed, pb_layout
from tests.daemon.harness import start_daemon

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 512 KiB blocks: 1.25 GiB of shm files (device and host tiers, populated) on tmpfs take
# seconds to make on the loaded dev host; the small pool beside it is made at once
SLOW = pc.KVLayout("slow-pool", num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16",
                   block_size=16)


def daemon_config(shm: str, model_id: str, device: int, host: int, disk: int) -> str:
    """A daemon config (``lease_s`` left to ``start_daemon``) with one model's own pool sizes."""
    return f"""
[engine]
sync = "commit"
shm_dir = "{shm}"

[engine.blocks]
device = 64
host = 256
disk = 1024

[engine.blocks.models."{model_id}"]
device = {device}
host = {host}
disk = {disk}

[daemon]
lease_s = {{lease_s}}
"""


class Caller(threading.Thread):
    """A client calling Lookup in a loop, noting each call's (start, end)."""

    def __init__(self, d, name: str, layout: pb.KVLayout | None = None) -> None:
        super().__init__(daemon=True)
        self.stub = d.stub()
        self.sid = self.stub.Attach(pb.AttachRequest(client_name=name, layout=layout or pb_layout()),
                                    timeout=60).session_id
        self.calls: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        tokens = packed(list(range(1000, 1040)))
        try:
            while not self.stop.is_set():
                start = time.monotonic()
                self.stub.Lookup(pb.LookupRequest(session_id=self.sid, tokens=tokens), timeout=60)
                self.calls.append((start, time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        assert self.error is None, self.error

    def within(self, start: float, end: float) -> list[tuple[float, float]]:
        return [c for c in self.calls if c[0] >= start and c[1] <= end]


def sessions(d) -> int:
    return d.stub().Status(pb.StatusRequest(), timeout=30).sessions


@pytest.fixture
def tmpfs():
    path = tempfile.mkdtemp(prefix="pd-offloop-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_attach_whose_pool_takes_seconds_to_make_meets_its_deadline_and_leaves_no_session(tmpfs):
    """Regression: the first Attach of a layout made the pool's files on the event loop: a
    client with a 5 s deadline got DEADLINE_EXCEEDED while the daemon was up, the session the
    Attach then made lingered until its lease ran out, and every other call waited the
    whole make. Now the make runs beside the loop; an Attach waits for it until just before
    its deadline and then answers UNAVAILABLE (nothing made in its name), and the client
    library, retrying UNAVAILABLE, gets its session once the pool is there."""
    with start_daemon(daemon_config(tmpfs, SLOW.model_id, 512, 2048, 64), lease_s=30.0) as d:
        other = Caller(d, "other")
        other.start()
        while not other.calls:
            time.sleep(0.01)
        stub = d.stub()
        slow = pb.KVLayout(model_id=SLOW.model_id, num_layers=SLOW.num_layers,
                           num_kv_heads=SLOW.num_kv_heads, head_dim=SLOW.head_dim,
                           dtype=SLOW.dtype, block_size=SLOW.block_size)
        began = time.monotonic()
        short = None
        try:
            short = stub.Attach(pb.AttachRequest(client_name="short", layout=slow), timeout=2.0)
        except grpc.RpcError as exc:
            # UNAVAILABLE just before the deadline; on a loaded host the loop may wake up
            # past it, and then the client's own deadline answers first
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                assert "being made" in exc.details() or "deadline passed" in exc.details()
            else:
                assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, (exc.code(), exc.details())
        with pc.connect(d.socket, SLOW, name="patient", mapped=False) as patient:
            made_s = time.monotonic() - began
            assert patient.id
            expected = 2 + (short is not None)  # a timed-out Attach left no session behind
            assert sessions(d) == expected
            assert d.log_text().count("session attached") == expected
        other.finish()
        during = other.within(began, began + made_s)
        worst = max(end - start for start, end in during)
        lag = stub.Stats(pb.StatsRequest(), timeout=30).values["prefixd_loop_lag_max_seconds"]
        print(f"\npool made in {made_s:.2f} s; meanwhile {len(during)} calls of another client, "
              f"the slowest {worst * 1e3:.0f} ms; loop lag max {lag * 1e3:.0f} ms")
        if made_s > 1.0:  # a make long enough to tell a held loop from a free one
            # a loop held by the make answers nothing until it ends: calls began and ended
            # within each half of it
            half = began + made_s / 2
            assert len(during) >= 5, "no call was answered while the pool was being made"
            assert any(end <= half for _, end in during), "no call answered in the make's first half"
            assert any(start >= half for start, _ in during), "no call answered in its second half"
        assert short is not None or made_s > 1.5


NUM_BLOCKS = 300_000  # the largest the suite builds in ~10 s; the 1M figure is a bench's
DISK_BLOCKS = 340_000  # room for the evictions' headroom beside them
NUM_CLIENTS = 8


def fill(recovery_state, pool_dir: str, shm_dir: str) -> None:
    """``NUM_BLOCKS`` blocks into the pool in ``pool_dir`` through the engine itself, with
    ``bench/recovery.py``'s traffic (shared system prompts, conversations off them)."""
    from prefixd.engine.durable import DurableCache

    dc = DurableCache(pool_dir, recovery_state.LAYOUT,
                      (recovery_state.DEVICE_BLOCKS, recovery_state.HOST_BLOCKS, DISK_BLOCKS),
                      shm_dir=shm_dir, sync="none", checkpoint_records=1 << 60,
                      checkpoint_blocks=1 << 60, spill_blocks=4096)
    traffic = recovery_state.Traffic(0, num_systems=NUM_BLOCKS // 5000)
    recovery_state.fill_disk(dc, traffic, NUM_BLOCKS)
    dc.checkpoint()
    dc.close()


def settle_lag(stub, below_s: float = 0.2, timeout_s: float = 60.0) -> None:
    """Until the loop lag's 10 s window holds no stall longer than ``below_s``."""
    deadline = time.monotonic() + timeout_s
    while stub.Stats(pb.StatsRequest(), timeout=30).values["prefixd_loop_lag_max_seconds"] >= below_s:
        assert time.monotonic() < deadline, "the idle daemon's loop keeps stalling"
        time.sleep(0.5)


class Opener(Caller):
    """A client opening and releasing prompts of the big pool's layout in a loop (each open
    allocates device blocks and may evict: the engine changes while the checkpoint runs)."""

    def __init__(self, d, name: str, layout: pb.KVLayout, seed: int) -> None:
        super().__init__(d, name, layout)
        self.seed = seed

    def run(self) -> None:
        import random

        rng = random.Random(self.seed)
        try:
            while not self.stop.is_set():
                tokens = packed([rng.randrange(128_000) for _ in range(16 * rng.randrange(1, 9) + 3)])
                start = time.monotonic()
                seq = self.stub.Open(pb.OpenRequest(session_id=self.sid, tokens=tokens),
                                     timeout=60).sequence
                self.stub.Release(pb.ReleaseRequest(session_id=self.sid, seq_id=seq.seq_id),
                                  timeout=60)
                self.calls.append((start, time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_a_checkpoint_of_a_large_pool_lets_eight_clients_calls_through():
    """Regression: a checkpoint (``prefixctl checkpoint``, the engine's trigger, the stop) ran
    its dump and waited for its LMDB write on the event loop, holding every call for its
    whole duration (0.6-3 s at 1M blocks). Now the picture is taken on the loop, the bytes are
    made on a worker thread and written by the log's committer, and calls go on meanwhile; a
    restart after it recovers every block."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "recovery_parts"))
    import recovery_state

    lay = recovery_state.LAYOUT
    layout = pb.KVLayout(model_id=lay.model_id, num_layers=lay.num_layers,
                         num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
                         block_size=lay.block_size)
    base = tempfile.mkdtemp(prefix="pd-", dir="/dev/shm")
    with start_daemon(daemon_config("{shm}", "bench-tiny", 2048, 8192, DISK_BLOCKS), lease_s=30.0,
                      base=base) as d:
        stub = d.stub()
        sid = stub.Attach(pb.AttachRequest(client_name="maker", layout=layout), timeout=60).session_id
        stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)
        assert d.stop() == 0
        pool_dir = next(os.path.join(root, name) for root, dirs, _ in
                        os.walk(os.path.join(d.state_dir, "pools")) for name in dirs
                        if name.startswith("bench-tiny-"))
        fill(recovery_state, pool_dir, d.shm_dir)
        d.start(timeout=300)
        indexed = sum(p.blocks[2] for p in stub.Status(pb.StatusRequest(), timeout=30).pools)
        assert indexed >= NUM_BLOCKS
        settle_lag(stub)  # the start's own stalls (recovery, the heap's freeze) out of the window
        clients = [Opener(d, f"c{i}", layout, i) for i in range(NUM_CLIENTS)]
        for c in clients:
            c.start()
        while not all(c.calls for c in clients):
            time.sleep(0.01)
        began = time.monotonic()
        assert stub.Checkpoint(pb.CheckpointRequest(), timeout=120).pools == 1
        ended = time.monotonic()
        time.sleep(0.2)
        for c in clients:
            c.finish()
        during = [call for c in clients for call in c.within(began, ended)]
        values = stub.Stats(pb.StatsRequest(), timeout=30).values
        p99, worst = values["prefixd_loop_lag_p99_seconds"], values["prefixd_loop_lag_max_seconds"]
        print(f"\ncheckpoint of {indexed} blocks took {ended - began:.2f} s with {NUM_CLIENTS} "
              f"clients; {len(during)} of their calls began and ended inside it; loop lag over "
              f"the last 10 s p99 {p99 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms")
        print(*[line for line in d.log_text().splitlines() if "checkpoint taken" in line], sep="\n")
        assert len(during) >= NUM_CLIENTS, "the clients' calls waited for the checkpoint"
        # loosely (the host's own load moves it by a tenth of a second): the strict figure,
        # p99 < 10 ms, is the benchmark's
        assert p99 < 0.5, f"loop lag p99 {p99 * 1e3:.0f} ms around a checkpoint"
        assert d.stop() == 0
        log = d.log()
        assert "Traceback" not in log and "checkpoint at stop pools=" in log, log[-3000:]
        d.start(timeout=300)
        again = sum(p.blocks[2] for p in d.stub().Status(pb.StatusRequest(), timeout=30).pools)
        assert again == indexed


TRIGGER_CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
checkpoint_records = 40

[engine.blocks]
device = 64
host = 512
disk = 4096

[daemon]
lease_s = {lease_s}
"""


def test_checkpoints_the_engine_triggers_run_beside_commits_and_a_restart_keeps_every_commit():
    """With a checkpoint every 40 records, the engine's trigger starts checkpoints beside
    the loop (``OffLoop.watch``) while two clients commit: every acknowledged commit is a
    hit after a clean stop and after a kill -9 (the log after each checkpoint's lsn holds
    what the checkpoint's picture did not see)."""
    from tests.daemon.gsp_workload import BS, write_kv

    with start_daemon(TRIGGER_CONFIG, lease_s=30.0) as d:
        committed: list[list[int]] = []
        errors: list[BaseException] = []

        def client(seed: int) -> None:
            import random

            rng = random.Random(seed)
            stub = d.stub()
            sid = stub.Attach(pb.AttachRequest(client_name=f"w{seed}", layout=pb_layout()),
                              timeout=30).session_id
            try:
                for _ in range(60):
                    tokens = [rng.randrange(50000, 90000) for _ in range(BS * rng.randrange(1, 4) + 3)]
                    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)),
                                    timeout=30).sequence
                    write_kv(stub, sid, seq.seq_id, tokens, seq.cached_tokens)
                    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True,
                                                   durability="crash"), timeout=30)
                    committed.append(tokens)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        log = d.log()
        assert log.count("wal checkpoint") >= 5, "the trigger started no checkpoints"
        assert "checkpoint failed" not in log and "Traceback" not in log, log[-3000:]

        def check_hits() -> None:
            stub = d.stub()
            sid = stub.Attach(pb.AttachRequest(client_name="check", layout=pb_layout()),
                              timeout=30).session_id
            for tokens in committed:
                cached = stub.Lookup(pb.LookupRequest(session_id=sid, tokens=packed(tokens)),
                                     timeout=30)
                assert cached.cached_tokens + cached.unverified_tokens == len(tokens) // BS * BS
            stub.Detach(pb.DetachRequest(session_id=sid), timeout=30)

        check_hits()
        d.kill()  # no checkpoint at stop: the last trigger's checkpoint and the log after it
        d.start()
        check_hits()
        assert d.stop() == 0
        d.start()
        check_hits()


def test_a_checkpoint_the_trigger_starts_on_a_full_filesystem_warns_once_and_waits(tmp_path, caplog):
    """Its write raises ``WalNoSpaceError`` (the log intact): one WARNING, no ERROR, the
    pool's trigger waits before the next; the pool keeps committing."""
    import asyncio
    from concurrent.futures import Future

    from prefixd.api.layout import KVLayout
    from prefixd.daemon.offloop import OffLoop
    from prefixd.engine.durable import DurableCache
    from prefixd.wal import WalNoSpaceError

    layout = KVLayout("full", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)
    dc = DurableCache(str(tmp_path / "state"), layout, (16, 64, 0), shm_dir=str(tmp_path / "shm"))
    offloop = OffLoop()

    def no_space(picture, index, seqs):
        fut = Future()
        fut.set_exception(WalNoSpaceError(dc.state_dir, OSError(28, "No space left on device")))
        return fut

    dc.upkeep.submit_checkpoint = no_space

    async def run() -> None:
        offloop.watch(dc)
        for n in (1, 2):
            dc.on_checkpoint_due()
            while offloop.num_failed < n:
                await asyncio.sleep(0.01)
            for _ in range(10):  # the task's last steps: the warning, its done callback
                await asyncio.sleep(0)

    try:
        with caplog.at_level("WARNING"):
            asyncio.run(run())
        assert [r.levelname for r in caplog.records if "checkpoint" in r.getMessage()] == ["WARNING"]
        assert dc.upkeep.trigger.not_before > 0 and offloop.num_failed == 2
        seq = dc.open(list(range(9)))
        dc.commit(seq.id).result()
        assert dc.wal.failure is None
    finally:
        offloop.close()
        dc.close()
