"""Drive a cache with a workload, one request at a time, timing each operation.

Shared by ``bench/core.py`` and ``make demo`` so both measure the same thing.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off for a timed loop (after one collection, so the loop starts
    with nothing to collect), back on when it ends: a collection would otherwise be timed as
    the operation it lands in. The benchmarks' timed loops all run under it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def replay(cache, reqs) -> dict[str, list[int]]:
    """Per request: open(prompt); extend(output − 1 tokens); commit; release.

    Returns nanoseconds per operation, one entry per request, under keys ``open``,
    ``extend``, ``commit``, ``release``. Events are drained and dropped (no WAL here).
    """
    times: dict[str, list[int]] = {"open": [], "extend": [], "commit": [], "release": []}
    t_open, t_ext, t_com, t_rel = (times[k].append for k in ("open", "extend", "commit", "release"))
    clock = time.perf_counter_ns
    with gc_paused():
        for req in reqs:
            t0 = clock()
            seq = cache.open(req.prompt)
            t1 = clock()
            cache.extend(seq.id, req.output[:-4])
            t2 = clock()
            cache.commit(seq.id)
            t3 = clock()
            cache.release(seq.id)
            t4 = clock()
            cache.drain_events()
            t_open(t1 - t0)
            t_ext(t2 - t1)
            t_com(t3 - t2)
            t_rel(t4 - t3)
    return times


def summarize(times: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Median and p99 in microseconds per operation."""
    out = {}
    for name, values in times.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        out[name] = {"median_us": round(statistics.median(ordered) / 1000, 3),
                     "p99_us": round(p99 / 1000, 3)}
    return out
