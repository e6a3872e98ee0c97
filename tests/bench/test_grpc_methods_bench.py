"""Smoke test of ``bench/grpc_methods.py``: both servers start, answer, and the JSON carries
each mode's CPU and time per call. Speed is never asserted here (the bench prints it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "grpc_methods.py")


def test_grpc_methods_bench_prints_both_modes():
    proc = subprocess.run([sys.executable, BENCH, "--json", "--calls", "40", "--reps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["bench"] == "grpc_methods"
    for key in ("server_cpu_us", "wall_us"):
        for mode in ("generic", "registered"):
            assert len(out[key][mode]["by_rep"]) == 2
            assert out[key][mode]["median"] > 0
    assert out["cpu_ratio"] > 0 and 0 <= out["reps_generic_cheaper"] <= 2
