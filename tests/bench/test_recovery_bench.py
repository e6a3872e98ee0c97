"""Smoke test of ``bench/recovery.py`` on a tiny state: each case builds its state directory,
ends (the default trigger's tail stops at the trigger's checkpoint, the forced tail at its
record count), and recovers in a fresh process what it left at close. Speed is not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "recovery.py")


def test_recovery_bench_builds_and_recovers_each_case(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--json", "--sizes", "2000", "--tail", "300",
                           "--repeats", "1", "--long-size", "0", "--wal-reps", "1",
                           "--wal-records", "640", "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["bench"] == "recovery"
    for case in ("recovery.2000", "forced_tail.2000"):
        build, lazy = out[case]["build"], out[case]["lazy"]
        assert build["tail_records"] > 0, (case, build)
        assert lazy["records_replayed"] >= build["tail_records"], (case, lazy)
        # the host and disk tiers come back as they were at close (the device tier starts empty)
        assert lazy["blocks_by_tier"][1:] == build["blocks_by_tier_at_close"][1:], (case, lazy)
        assert out[case]["ready_s"] > 0
    assert out["forced_tail.2000"]["build"]["tail_records"] in (300, 301)  # a release may end it
    assert out["recovery.2000"]["eager"]["blocks_by_tier"] == out["recovery.2000"]["lazy"]["blocks_by_tier"]
    assert out["wal.records_per_s"] > 0 and out["wal.floor_records_per_s"] > 0
