"""One run of the daemon fuzz (``test_fuzz.py``) against a live daemon: the drawn steps
(``step``: an rpc call of ``fuzz_draw``, raw bytes, a call that vanishes), their schedule (a
warm-up, then a sample of the daemon's memory and fds every ``SAMPLE_EVERY`` calls and a client
process SIGKILLed every ``KILL_EVERY``), and the bounds that say the daemon stays flat (``Run``).
What the valid calls put in the index is the ``Fuzzer``'s model (``fuzz_ops``).
"""

from __future__ import annotations

import collections
import os
import random
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.api import prefixd_pb2 as pb
from tests.daemon import fuzz_draw
from tests.daemon.fuzz_ops import Fuzzer
from tests.daemon.fuzz_vanishing_clients import kill_a_client, raw_bytes, vanish_mid_call

CALLS = 10_000
WARMUP = 2_000
SAMPLE_EVERY = 250
KILL_EVERY = 2_500
# NOTE (what "flat" measures): the daemon's anonymous and shared memory (RSS less mapped
# files: the log's LMDB map grows ~6 MiB over the soak's 100k calls, page cache) less the free
# bytes inside its malloc heap (``prefixd_heap_free_bytes``): the daemon keeps up to 64 MiB of
# freed heap for its next multi-MiB message (``prefixd.daemon.heap``), and the fuzz's
# oversized messages leave it there. Over the soak RSS rises ~25 MiB, ~20 of it free heap and
# mapped files, so a bound on RSS alone fails the soak. What is left may grow by 5% of its warm
# value plus 8 MiB (16 in the soak): the garbage cycles of refused calls wait for Python's
# oldest generation, a sawtooth of ~10 MiB with a period of ~16k calls in the soak; glibc
# arenas and gRPC's per-thread caches settle in steps of a few MiB; and the valid calls grow the
# index by a few thousand blocks (state, not a leak: allowed ``INDEX_KB_PER_BLOCK`` each, and
# the daemon's KV-event ring is kept small here so that it is full before the warm-up ends).
# Fds by 5% plus 6: each vanishing client (raw socket, closed channel, killed process) holds
# one server-side fd until gRPC's poller sees the hang-up, and a sample may catch a few of those.
RSS_SLACK_KB = 8 << 10
INDEX_KB_PER_BLOCK = 1  # the engine's index holds ~0.6 KiB a committed block of this layout
FD_SLACK = 6
FDS_PER_POOL = 12  # an open pool's log, files and threads' fds (9 measured), a pool open since warm-up
SHM_KB_PER_POOL = 4 << 10  # an open pool's first device and host extents: shm pages (4 MiB measured)


def rss_kb(pid: int) -> tuple[int, int]:
    """``(RSS, its anonymous and shared-memory part)`` in KiB: the second leaves out pages of
    mapped files (the log's LMDB map, libraries), page cache the kernel may drop."""
    with open(f"/proc/{pid}/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
              if k in ("VmRSS", "RssAnon", "RssShmem")}
    return kb["VmRSS"], kb["RssAnon"] + kb["RssShmem"]


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def other_socket(d) -> str:
    return os.path.join(os.path.dirname(d.socket), "other.sock")


def step(d) -> tuple:
    """One drawn step: an rpc call (``fuzz_draw.op``), or 1 in 20 times raw bytes on the socket
    or a call that vanishes."""
    if d.int(0, 19):
        return fuzz_draw.op(d)
    if d.bool():
        return "raw", d.bytes(0, 512), d.bool(), d.bool()
    return "vanish", d.int(0, 11), d.int(0, 3000)


class Run:
    """One fuzz run against ``d``: its counts and its RSS / fd samples."""

    def __init__(self, d, target: int) -> None:
        self.d, self.target = d, target
        self.rss_slack_kb = RSS_SLACK_KB if target <= CALLS else 2 * RSS_SLACK_KB
        self.committed0 = int(d.stub().Stats(pb.StatsRequest()).values["prefixd_committed_blocks_total"])
        self.fuzzer = Fuzzer(d.stub(), d.stub(other_socket(d)), d.previous,
                             {k: set(v) for k, v in d.indexed.items()})
        self.rng = random.Random(11)
        self.raw = self.kills = 0
        self.warm: tuple[int, ...] | None = None
        self.samples: list[tuple[int, ...]] = []
        self.next_sample = WARMUP
        self.next_kill = KILL_EVERY // 2
        self.started = time.monotonic()
        for lay in fuzz_draw.ALT_LAYOUTS + fuzz_draw.FILLER_LAYOUTS:  # every pool, before warm-up
            self.fuzzer.attach(lay, "pool-maker")
            self.fuzzer.detach(self.fuzzer.live[-1])
        self.step_seconds: collections.Counter[str] = collections.Counter()
        self.hypothesis_calls = 0

    @property
    def total(self) -> int:
        return sum(self.fuzzer.calls.values()) + self.raw

    def step(self, item) -> None:
        kind = item[0]
        t0 = time.perf_counter()
        try:
            self._step(item)
        finally:
            self.step_seconds[kind if kind in ("raw", "vanish") else "op"] += time.perf_counter() - t0

    def _step(self, item) -> None:
        kind = item[0]
        if kind == "raw":
            self.raw += 1
            raw_bytes(self.d, *item[1:])
        elif kind == "vanish":
            vanish_mid_call(self.d, self.fuzzer, *item[1:])
        else:
            self.fuzzer.run(kind, item[1])

    def example(self, steps) -> None:
        for item in steps:
            if self.total >= self.target:
                return
            self.step(item)
        pid = self.d.pid()
        assert self.d.proc.poll() is None, f"the daemon died:\n{self.d.log()}"
        if self.total >= self.next_kill:
            self.next_kill += KILL_EVERY
            t0 = time.perf_counter()
            kill_a_client(self.d, self.rng)
            self.step_seconds["kill"] += time.perf_counter() - t0
            self.kills += 1
        if self.total >= self.next_sample:
            self.next_sample += SAMPLE_EVERY
            indexed, heap_free = self.stats()
            rss, anon = rss_kb(pid)
            pools = len(self.fuzzer.stub.Status(pb.StatusRequest()).pools)
            sample = (self.total, anon - heap_free // 1024, num_fds(pid), indexed, rss, pools)
            if self.warm is None:
                self.warm = sample[1:]
            self.samples.append(sample)
            rss0, fds0 = self.warm[:2]
            index_kb = max(0, indexed - self.warm[2]) * INDEX_KB_PER_BLOCK
            more_pools = max(0, pools - self.warm[4])  # empty pools close and open again
            pools_kb = SHM_KB_PER_POOL * more_pools  # counted: anon + shmem
            assert sample[1] <= rss0 * 1.05 + self.rss_slack_kb + index_kb + pools_kb, (self.warm, sample)
            assert sample[2] <= fds0 * 1.05 + FD_SLACK + FDS_PER_POOL * more_pools, (self.warm, sample)

    def stats(self) -> tuple[int, int]:
        """Blocks the valid calls have put in the index so far (the daemon's count: reported
        beside RSS, since a growing index is state, not a leak), and the free bytes inside the
        daemon's malloc heap (0 where it does not say)."""
        values = self.fuzzer.stub.Stats(pb.StatsRequest()).values
        return (int(values["prefixd_committed_blocks_total"]),
                int(values.get("prefixd_heap_free_bytes", 0)))

    def go(self, *, derandomize: bool, seed: int) -> None:
        """A fifth of the calls drawn by hypothesis, the rest by ``random.Random(seed)``."""
        @settings(max_examples=max(10, self.target // 5 // 12), deadline=None, database=None,
                  derandomize=derandomize, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def fuzz(data):
            d = fuzz_draw.HypothesisDraw(data)
            self.example(step(d) for _ in range(d.int(1, 24)))

        fuzz()
        self.hypothesis_calls = self.total
        d = fuzz_draw.RandomDraw(random.Random(seed))
        while self.total < self.target:
            self.example(step(d) for _ in range(d.int(1, 24)))

    def report(self) -> str:
        f = self.fuzzer
        return (f"calls={self.total} by_hypothesis={self.hypothesis_calls} raw={self.raw} kills={self.kills} "
                f"seconds={time.monotonic() - self.started:.1f} codes={dict(f.codes)} "
                f"per_rpc={dict(f.calls)} "
                f"rpc_seconds={ {k: round(v, 2) for k, v in f.seconds.items()} } "
                f"warm(live_kb,fds,indexed,rss_kb)={self.warm} "
                f"last={self.samples[-1] if self.samples else None} "
                f"max_rss_kb={max((s[1] for s in self.samples), default=0)} "
                f"max_fds={max((s[2] for s in self.samples), default=0)} "
                f"step_seconds={ {k: round(v, 2) for k, v in self.step_seconds.items()} } "
                f"samples(calls,live_kb,fds,indexed,rss_kb,pools)={self.samples[::max(1, len(self.samples) // 12)]}")
