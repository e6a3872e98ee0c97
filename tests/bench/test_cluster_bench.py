"""Smoke test of ``bench/cluster.py``: it runs against a real cluster and prints every key the
bench's targets judge. Speed is never asserted here (the bench prints it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cluster.redis_fixture import require_redis

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "cluster.py")


def test_cluster_bench_prints_fetch_floor_and_hit_rates():
    require_redis()
    proc = subprocess.run([sys.executable, BENCH, "--json", "--reps", "1", "--groups", "1",
                           "--prompts", "2", "--prefix-tokens", "256"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fetch, hits = out["fetch"], out["hit_rate"]
    for key in ("floor.mget_gbps", "floor.mget_nonatomic_gbps", "store.get_run_gbps",
                "remote.fetch_gbps", "store.get_run_vs_floor", "remote.fetch_vs_floor"):
        assert fetch[key] > 0, key
    assert fetch["promoted_blocks"] == [16]  # the whole prefix came from the cluster
    assert hits["remote.hit_rate"] > hits["local.ideal_hit_rate"]  # the fleet shared something
    assert 0 < hits["remote.ideal_hit_rate"] <= 1
