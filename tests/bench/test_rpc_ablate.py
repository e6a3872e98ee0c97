"""Smoke tests of ``bench/rpc_ablate.py`` (the gsp request with parts taken out) and of its
daemon wrapper. Speed is never asserted here (the bench prints it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "rpc_ablate.py")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_rpc_ablate_prints_every_side_and_the_engineless_daemon_logs_nothing():
    """Every side gets a rate and a latency; the daemons that run the engine logged the
    requests' records, the one with the engine taken out logged none (it really answered
    without it)."""
    proc = subprocess.run([sys.executable, BENCH, "--phases", "1", "--requests", "4", "--rounds", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert set(out["sides"]) == {"echo", "daemon", "no_engine", "no_wait"}
    for name, side in out["sides"].items():
        assert _positive(side["rps_8"]) and _positive(side["p50_us"]), name
        assert len(side["rps_8_by_run"]) == 1, name
    for name in ("daemon", "no_engine", "no_wait"):
        side = out["sides"][name]
        assert _positive(side["open_p50_us"]) and _positive(side["release_p50_us"]), name
        assert set(out["ratios"][name]) == {"rps_8_over_echo", "p50_over_echo"}, name
    # 8 workers x (16 warm-up + 4) requests and 2 x 30 one-client requests: each one at least
    # an open record
    assert out["sides"]["daemon"]["log_records"] >= 8 * 20 + 60
    assert out["sides"]["no_wait"]["log_records"] >= 8 * 20 + 60
    assert out["sides"]["no_engine"]["log_records"] == 0


def test_rpc_ablate_refuses_empty_counts():
    proc = subprocess.run([sys.executable, BENCH, "--rounds", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


def test_the_ablation_daemon_refuses_an_unknown_ablation():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rpc_ablate_daemon.py"), "serve"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PREFIXD_ABLATE="everything", PYTHONPATH=ROOT))
    assert proc.returncode != 0 and "PREFIXD_ABLATE must be one of engine, wait" in proc.stderr
