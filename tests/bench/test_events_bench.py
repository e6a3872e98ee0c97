"""Smoke test of ``bench/events.py``: two short rounds of both daemons at once print every key
its targets judge. Speed is never asserted here (the bench prints it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "events.py")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_events_bench_two_short_rounds_print_every_judged_key():
    proc = subprocess.run([sys.executable, BENCH, "--json", "--rounds", "2", "--seconds", "1",
                           "--clients", "2", "--warmup", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=540, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["design"] == "simultaneous" and out["aa"] is False and out["rounds"] == 2
    for side in ("off", "publish"):
        s = out[side]
        for key in ("per_request_us", "mean_per_request_us", "daemon_cpu_us_per_request"):
            assert _positive(s[key]), (side, key)
        assert len(s["per_request_us_by_round"]) == 2
        assert len(s["daemon_cpu_us_per_request_by_round"]) == 2
    for key in ("ratio", "ratio_paired_median", "cpu_ratio", "cpu_ratio_paired_median",
                "events_per_s", "batches_per_s", "lag_p99_ms"):
        assert _positive(out[key]), key
    assert len(out["ratio_by_round"]) == len(out["cpu_ratio_by_round"]) == 2
    assert out["ratio"] == round(out["publish"]["per_request_us"] / out["off"]["per_request_us"], 3)
    assert _positive(out["publish"]["loop_us_per_request"])
    assert out["lag_p50_ms"] <= out["lag_p99_ms"] and out["lag_samples"] > 0
    assert out["dropped_batches"] == 0 and out["subscriber_gaps"] == 0
    assert _positive(out["host"]["load_1m_start"]) and _positive(out["host"]["load_1m"])


def test_events_per_s_counts_only_batches_received_inside_the_window(tmp_path):
    """Warm-up traffic (before the window) and the flush after it are decoded, but only what
    arrives inside the measured window counts toward ``events_per_s`` / ``batches_per_s``."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "events_parts"))
    from events_subscriber import Subscriber

    sub = Subscriber(f"ipc://{tmp_path}/none")
    try:
        batch = msgpack.packb([0.0, [{"type": "BlockRemoved", "medium": "GPU"}] * 3, None])
        sub.raw.extend((t, seq.to_bytes(8, "big"), batch) for seq, t in enumerate((5.0, 10.0, 15.0, 21.0)))
        sub.drain((10.0, 20.0))
    finally:
        sub.close()
    assert (sub.batches, sub.events) == (4, 12)
    assert (sub.window_batches, sub.window_events) == (2, 6) and sub.gaps == 0
