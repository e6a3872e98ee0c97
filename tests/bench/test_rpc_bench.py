"""Smoke tests of ``bench/rpc.py``: it runs against a real daemon and prints every key its
targets judge. Speed is never asserted here (the bench prints it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "rpc.py")

RATIOS = ("rpc_p50_over_floor", "rps_8_over_floor", "kv_mapped_over_memcpy",
          "kv_rpc_over_grpc_bytes", "attend_over_floor")


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--json", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_rpc_bench_one_client_section_prints_rpc_and_floor():
    """The default-suite check (one client only, a few seconds past the daemon's start): the
    one-client keys, the floor's parts, the record bytes read back from the daemon's log."""
    out = _run("--sections", "rpc")
    assert out["bench"] == "rpc" and out["client"].startswith("prefixd.client")
    for key in ("p50_us", "p99_us", "open_p50_us", "release_p50_us"):
        assert _positive(out["rpc"][key]), key
    for key in ("p50_us", "p99_us", "echo_pair_p50_us"):
        assert _positive(out["floor"][key]), key
    assert out["one_client"]["record_bytes"]["median_bytes"] > 0
    assert out["one_client"]["wal_txns_per_request"] > 0  # read from the daemon's WAL
    assert _positive(out["ratios"]["rpc_p50_over_floor"])
    assert out["ratios"]["kv_mapped_over_memcpy"] is None  # section not run: no made-up ratio


def test_combine_runs_is_all_requests_over_all_seconds():
    """The 8-client phases of one side combine by their totals, not by the mean of their rates."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "rpc_parts"))
    from rpc_load import combine_runs

    runs = [{"requests": 100, "seconds": 1.0, "rps": 100.0, "client_cpu_us": 800.0, "latencies_ns": [1000, 3000]},
            {"requests": 300, "seconds": 1.5, "rps": 200.0, "client_cpu_us": 400.0,
             "latencies_ns": [2000, 4000, 5000]}]
    out = combine_runs(runs)
    assert out["requests"] == 400 and out["seconds"] == 2.5 and out["rps"] == 160.0
    assert out["client_cpu_us"] == 500.0  # all CPU over all requests, not the mean of 800 and 400
    assert out["rps_by_run"] == [100.0, 200.0] and "latencies_ns" not in out
    assert out["p50_us"] == 3.0 and out["p99_us"] == 5.0


@pytest.mark.soak
def test_rpc_bench_quick_prints_every_judged_key():
    """``bench/rpc.py --quick --json``: every measurement and ratio its targets name."""
    out = _run()
    for key in ("p50_us", "p99_us", "rps_8"):
        assert _positive(out["rpc"][key]), key
    for key in ("p50_us", "rps_8", "memcpy_gbps", "grpc_bytes_gbps", "attend_us"):
        assert _positive(out["floor"][key]), key
    assert _positive(out["kv"]["mapped_gbps"]) and _positive(out["kv"]["rpc_gbps"])
    assert _positive(out["attend"]["rpc_us"])
    # the floor is the faster of the in-process call with torch's threads and with one
    modes = out["floor"]["attend_by_threads"]
    assert sorted(m["threads"] for m in modes)[0] == 1 and len(modes) == 2
    assert out["floor"]["attend_us"] == min(m["us"] for m in modes)
    assert out["floor"]["attend_kernel_us"] in [m["kernel_us"] for m in modes]
    assert out["eight_clients"]["workers"] == 8 and out["eight_clients"]["phases"] == 3
    for side in ("rpc", "floor"):  # one rate per phase, and the side's rate over all of them
        runs = out["eight_clients"][side]
        assert len(runs["rps_by_run"]) == 3 and all(map(_positive, runs["rps_by_run"]))
        assert min(runs["rps_by_run"]) <= runs["rps"] <= max(runs["rps_by_run"])
        assert _positive(runs["client_cpu_us"])
    assert _positive(out["eight_clients"]["rpc"]["requests_per_wal_txn"])
    for name in RATIOS:
        assert _positive(out["ratios"][name]), name
        assert name in out["targets"]










def test_server_cpus_pins_both_servers_and_refuses_cpus_it_cannot_use(tmp_path):
    """``--server-cpus``: the daemon and the echo floor start with the given affinity (every
    thread inherits it); a CPU outside this process's set is refused before anything starts."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "rpc_parts"))
    from affinity import parse_cpus, preexec

    mine = sorted(os.sched_getaffinity(0))
    one = frozenset(mine[-1:])
    assert parse_cpus(str(mine[-1])) == one
    with pytest.raises(Exception, match="may run on CPUs"):
        parse_cpus(str(max(mine) + 64))
    with pytest.raises(Exception, match="separated by commas"):
        parse_cpus("one")
    assert preexec(None) is None
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, preexec_fn=preexec(one), check=True)
    assert child.stdout.strip() == str(sorted(one))
    from rpc_daemon import BenchDaemon
    from rpc_echo import EchoServer

    with EchoServer(str(tmp_path / "echo.sock"), cpus=one) as echo, \
            BenchDaemon((64, 64, 0), ("tiny", 16), cpus=one) as daemon:
        assert os.sched_getaffinity(echo.proc.pid) == one
        for task in os.listdir(f"/proc/{daemon.proc.pid}/task"):  # gRPC's threads, the loop, ...
            assert os.sched_getaffinity(int(task)) == one
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--server-cpus", str(max(mine) + 64)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "may run on CPUs" in proc.stderr
