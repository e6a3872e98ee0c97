"""Engine benchmark: the durable engine's cost on the serving thread, and commits per second.

Prints one JSON object. gsp requests, each: ``open`` the prompt (2,176 tokens), ``extend`` by
the output (less its last token, as ``bench/core.py``), write the KV of every token the cache did
not serve (one ``index_fill_`` of its blocks in the device pool, not timed), ``commit`` at ``crash``, ``release``. KV layout 1 layer x 1
KV head x head dim 8, fp16, block 16: 512 bytes a block, so that the engine's own work shows, not
memcpy. Tiers: device 10% / host 40% / disk 150% of the working set, ``write_through``. Every
run starts from an empty state directory.

- ``core.per_request_us``: the same requests through the in-memory ``PrefixCache`` alone (same
  tier sizes, bookkeeping only), median of open + extend + commit + release.
- ``engine.nosync_per_request_us``: ``sync="none"``, one request at a time, median of open +
  extend + commit + release on the calling thread (tickets not waited for).
- ``commit.nosync_per_s``: that run's requests per second (KV writes included).
- ``commit.serial_per_s``: ``sync="commit"``, each request waits for its commit ticket.
- ``commit.concurrent_16_per_s``: ``sync="commit"``, 16 requests in flight on one serving
  thread; a request is released (and its lane starts the next) when its ticket resolves.
- ``commit.per_fsync``: commits acknowledged per WAL fsync in the concurrent run.

``--profile`` prints a cProfile of the nosync run to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from prefixd.api.layout import KVLayout  # noqa: E402
from prefixd.api.tiers import Tier  # noqa: E402
from prefixd.cache import PrefixCache  # noqa: E402
from prefixd.engine.durable import DurableCache  # noqa: E402
from prefixd.tools.driver import gc_paused  # noqa: E402
from prefixd.tools.workloads import gsp, working_set_tokens  # noqa: E402

BS = 16
LAYOUT = KVLayout("bench-engine", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=BS)
LANES = 16


def _sizes(reqs) -> tuple[int, int, int]:
    """Device 10% / host 40% / disk 150% of the working set; the device holds at least what
    ``LANES + 1`` requests pin at once (a ``--requests`` subset of gsp has a small working set)."""
    ws_blocks = working_set_tokens(reqs, BS) // BS
    per_request = max((len(r.prompt) + len(r.output)) // 4 // BS + 1 for r in reqs)
    device = max(ws_blocks // 10, (LANES + 1) * per_request)
    return device, max(1, ws_blocks * 4 // 10), max(1, ws_blocks * 15 // 10)


def _median_us(ns: list[int]) -> float:
    return round(statistics.median(ns) / 1000, 2)


def _p99_us(ns: list[int]) -> float:
    ordered = sorted(ns)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1000, 2)


def run_core(reqs, sizes) -> dict:
    cache = PrefixCache(sizes, BS, write_policy="write_through")
    clock = time.perf_counter_ns
    totals = []
    with gc_paused():
        for req in reqs:
            t0 = clock()
            seq = cache.open(req.prompt)
            cache.extend(seq.id, req.output[:-4])
            cache.commit(seq.id)
            cache.release(seq.id)
            t1 = clock()
            cache.drain_events()
            totals.append(t1 - t0)
    return {"per_request_us": _median_us(totals), "p99_us": _p99_us(totals),
            "hit_rate": round(cache.stats.hit_rate, 4)}


class _Engine:
    """A fresh DurableCache in its own temporary state and shm directories."""

    def __init__(self, sizes, sync: str) -> None:
        self.root = tempfile.mkdtemp(prefix="prefixd-bench-engine-")
        self.shm = tempfile.mkdtemp(prefix="prefixd-bench-engine-", dir="/dev/shm")
        self.dc = DurableCache(os.path.join(self.root, "state"), LAYOUT, sizes, sync=sync,
                               shm_dir=self.shm, checkpoint_records=10**9, checkpoint_blocks=10**12)
        self._pool = self.dc.store.pool(Tier.DEVICE).tensor

    def write(self, seq_id: int, start: int, end: int) -> None:
        """The client's KV write, as a paged-attention kernel would do it: the sequence's own
        blocks from ``start`` on, filled in the device pool in one op."""
        table = self.dc.sequence(seq_id).block_table
        first = start // BS
        if end > start and first < len(table):
            self._pool.index_fill_(0, torch.tensor(table[first:], dtype=torch.long), float(seq_id % 251))

    def close(self) -> None:
        try:
            self.dc.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            shutil.rmtree(self.shm, ignore_errors=True)


def run_serial(reqs, sizes, sync: str, wait: bool, profile: bool = False) -> dict:
    eng = _Engine(sizes, sync)
    dc = eng.dc
    clock = time.perf_counter_ns
    totals, by_op = [], {"open": [], "extend": [], "commit": [], "release": []}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    syncs0 = dc.wal.stats().syncs
    with gc_paused():
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        for req in reqs:
            t0 = clock()
            seq = dc.open(req.prompt)
            t1 = clock()
            dc.extend(seq.id, req.output[:-4])
            t2 = clock()
            n = (len(req.prompt) + len(req.output)) // 4 - 1
            eng.write(seq.id, seq.cached_tokens, n)
            t3 = clock()
            ticket = dc.commit(seq.id, "crash")
            t4 = clock()
            if wait:
                ticket.result()
            t5 = clock()
            dc.release(seq.id)
            t6 = clock()
            for name, ns in (("open", t1 - t0), ("extend", t2 - t1), ("commit", t4 - t3), ("release", t6 - t5)):
                by_op[name].append(ns)
            totals.append((t2 - t0) + (t4 - t3) + (t6 - t5))
        dc.flush().result()
        wall = time.perf_counter() - start
        if prof is not None:
            prof.disable()
    stats = dc.wal.stats()
    out = {"per_request_us": _median_us(totals), "p99_us": _p99_us(totals),
           "ops_median_us": {k: _median_us(v) for k, v in by_op.items()},
           "per_s": round(len(reqs) / wall, 1), "wal_fsyncs": stats.syncs - syncs0,
           "disk_fdatasyncs": dc.store.disk_syncs, "forced_reclaims": dc.forced_releases,
           "hit_rate": round(dc.cache.stats.hit_rate, 4)}
    eng.close()
    if prof is not None:
        import pstats

        pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(45)
    return out


def run_concurrent(reqs, sizes, lanes: int = LANES) -> dict:
    """``lanes`` requests in flight on this one thread: open, extend, write, commit; when the
    commit's ticket resolves, release and start the lane's next request."""
    eng = _Engine(sizes, "commit")
    dc = eng.dc
    resolved: queue.SimpleQueue = queue.SimpleQueue()
    todo = iter(reqs)
    live: dict[int, object] = {}
    latencies = []
    syncs0 = dc.wal.stats().syncs

    def start_next() -> bool:
        req = next(todo, None)
        if req is None:
            return False
        t0 = time.perf_counter_ns()
        seq = dc.open(req.prompt)
        dc.extend(seq.id, req.output[:-4])
        eng.write(seq.id, seq.cached_tokens, (len(req.prompt) + len(req.output)) // 4 - 1)
        ticket = dc.commit(seq.id, "crash")
        live[seq.id] = ticket
        ticket.add_done_callback(lambda _f, sid=seq.id, t=t0: resolved.put((sid, t)))
        return True

    with gc_paused():
        start = time.perf_counter()
        for _ in range(lanes):
            start_next()
        while live:
            sid, t0 = resolved.get()
            live.pop(sid).result()  # raises a failed commit
            latencies.append(time.perf_counter_ns() - t0)
            dc.release(sid)
            start_next()
        wall = time.perf_counter() - start
    stats = dc.wal.stats()
    fsyncs = stats.syncs - syncs0
    out = {"per_s": round(len(reqs) / wall, 1), "wal_fsyncs": fsyncs,
           "per_fsync": round(len(reqs) / max(1, fsyncs), 2),
           "commit_latency_median_us": _median_us(latencies), "commit_latency_p99_us": _p99_us(latencies),
           "disk_fdatasyncs": dc.store.disk_syncs, "forced_reclaims": dc.forced_releases,
           "hit_rate": round(dc.cache.stats.hit_rate, 4)}
    eng.close()
    return out


def run(num_requests: int, profile: bool, only_skip=()) -> dict:
    # NOTE: one torch thread: the bench's own KV writes are tiny, and on a busy 2-core host each
    # parallel op waited milliseconds for the second core (2.6 ms for a 150-block index_fill_)
    torch.set_num_threads(1)
    reqs = gsp()[:num_requests]
    sizes = _sizes(reqs)
    core = run_core(reqs, sizes)
    if profile:  # a run of its own: the profiler's overhead stays out of the numbers
        run_serial(reqs, sizes, "none", wait=False, profile=True)
    nosync = run_serial(reqs, sizes, "none", wait=False)
    skip = {"per_request_us": 0, "per_s": 0, "per_fsync": 0}
    serial = run_serial(reqs, sizes, "commit", wait=True) if "serial" not in only_skip else skip
    concurrent = run_concurrent(reqs, sizes) if "concurrent" not in only_skip else skip
    return {
        "workload": "gsp", "requests": len(reqs), "block_bytes": LAYOUT.block_bytes,
        "tiers_blocks": dict(zip(("device", "host", "disk"), sizes)),
        "core": core,
        "engine": {"nosync_per_request_us": nosync["per_request_us"], "nosync": nosync, "serial": serial,
                   "concurrent_16": concurrent},
        "commit": {"nosync_per_s": nosync["per_s"], "serial_per_s": serial["per_s"],
                   "concurrent_16_per_s": concurrent["per_s"], "per_fsync": concurrent["per_fsync"]},
        "engine_vs_core": round(nosync["per_request_us"] / core["per_request_us"], 2),
        "concurrent_vs_nosync": round(concurrent["per_s"] / nosync["per_s"], 3),
        "skipped": list(only_skip),
        "targets": {"engine_vs_core": "<= 4", "concurrent_vs_nosync": ">= 0.8", "per_fsync": ">= 4"},
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2048, help="the first N gsp requests (2048: all)")
    parser.add_argument("--profile", action="store_true", help="cProfile of the nosync run to stderr")
    parser.add_argument("--json", action="store_true", help="one line of JSON (the default is indented)")
    parser.add_argument("--skip", default="", help="comma list of runs to leave out: serial, concurrent")
    args = parser.parse_args()
    result = run(args.requests, args.profile, tuple(filter(None, args.skip.split(","))))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
