"""The event loop's lag (``prefixd.daemon.loop_lag``): a loop held shows up in the p99 / max of
the last 10 s and in the histogram, on a real loop and on a real daemon process (stopped with
SIGSTOP: the loop cannot run, as when a checkpoint holds it)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon.loop_lag import LAG_S_BOUNDS, LoopLag
from prefixd.daemon.metrics_http import scrape_unix
from tests.daemon.harness import METRICS_CONFIG, start_daemon

BLOCK_S = 0.6  # how long the daemon's loop is held


def test_a_blocked_loop_shows_in_the_max_the_p99_and_the_histogram():
    lag = LoopLag(period_s=0.005)

    async def main():
        loop = asyncio.get_running_loop()
        lag.start(loop)
        await asyncio.sleep(0.1)
        time.sleep(0.08)  # the block: nothing else runs on the loop meanwhile
        await asyncio.sleep(0.05)
        lag.stop()

    asyncio.run(main())
    p99, worst = lag.recent()
    assert worst >= 0.075 and p99 <= worst
    hist = lag.histogram()
    above = sum(n for bound, n in zip((0.0, *LAG_S_BOUNDS), hist.counts) if bound >= 0.05)
    assert above >= 5 and hist.total >= 0.075 and sum(hist.counts) == lag.num_samples > 10
    lag.check_invariants()


def test_a_stall_counts_every_firing_it_swallowed_and_leaves_the_window_after_10_s():
    """One late firing of ``L`` stands for the ``L / period`` firings the stall swallowed
    (a call arriving during it waited ``L``, ``L - period``, ...): the p99 is that of time."""
    now = [100.0]
    lag = LoopLag(period_s=0.005, window_s=10.0, clock=lambda: now[0])
    assert lag.recent() == (0.0, 0.0)
    lag.observe(100.0, 0.5)
    assert lag.num_samples == 100 and lag.recent() == (pytest.approx(0.495), 0.5)
    for i in range(1, 19_901):  # 99.5 % of the next 8 s on time: the stall is 0.5 % of it
        lag.observe(100.0 + i * 0.0004, 0.001)
    assert lag.recent() == (0.001, 0.5)
    lag.observe(100.0 + 19_901 * 0.0004, 0.001)
    now[0] = 110.2  # the stall's samples (99.5 .. 100.0) are more than 10 s old
    lag.observe(110.2, 0.002)
    assert lag.recent() == (0.001, 0.002)  # the max no longer the stall
    lag.check_invariants()
    hist = lag.histogram()  # keeps everything: 0.255 .. 0.5 in the bucket up to 0.5
    assert hist.counts[LAG_S_BOUNDS.index(0.5)] == 50 and sum(hist.counts) == lag.num_samples
    with pytest.raises(ValueError, match="period_s"):
        LoopLag(period_s=0)


def test_a_daemon_held_shows_the_stall_in_stats_and_on_the_metrics_endpoint():
    """The names are what ``bench/faults.py`` reads: ``prefixd_loop_lag_p99_seconds`` and
    ``prefixd_loop_lag_max_seconds`` in Stats, ``prefixd_loop_lag_seconds`` scraped."""
    with start_daemon(METRICS_CONFIG) as d:
        stub = d.stub()
        before = stub.Stats(pb.StatsRequest(), timeout=30).values
        assert before["prefixd_loop_lag_max_seconds"] < BLOCK_S
        d.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(BLOCK_S)  # the stall itself
        finally:
            d.proc.send_signal(signal.SIGCONT)
        values = stub.Stats(pb.StatsRequest(), timeout=30).values
        assert values["prefixd_loop_lag_max_seconds"] >= BLOCK_S - 0.1, values
        # 0.6 s of 10 s held: more than 1 % of the samples, so the p99 shows it too
        assert 0.1 < values["prefixd_loop_lag_p99_seconds"] <= values["prefixd_loop_lag_max_seconds"]
        fams = {f.name: f for f in text_string_to_metric_families(scrape_unix(f"{d.base}/m.sock"))}
        fam = fams["prefixd_loop_lag_seconds"]
        assert fam.type == "histogram"
        buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
        count = next(s.value for s in fam.samples if s.name.endswith("_count"))
        assert buckets["+Inf"] == count > 10
        assert buckets["0.25"] < count, "the held loop's late timer is not in the histogram"
