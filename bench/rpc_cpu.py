"""Where the CPU of ``bench/rpc.py``'s 8-client run goes, and whether the fsyncs bound it.

Three servers, each its own process on a Unix socket: the daemon as ``bench/rpc.py`` runs it
(``sync = "commit"``); the same daemon with ``sync = "none"`` (a commit waits for the WAL's
write transaction, never for an fsync: if ``rps_8`` were bound by the fsyncs, this one would
be faster); and the floor's bare echo server. ``--phases`` alternations of 8 client processes
against each: gsp requests through ``prefixd.client`` (both daemons get the same prompts, fresh
in each phase), echo pairs of the same message sizes for the floor. Per side:

- ``rps`` (and by phase), ``p50_us``, and ``client_cpu_us``: the clients' CPU per request
  while measured (user + system, all their threads, gRPC's included);
- ``server_cpu_us``: the server process's CPU per request by thread: ``loop`` (the main
  thread: the event loop, the handlers, the engine), ``event_engine`` (gRPC's I/O threads),
  ``other`` (the WAL committer, the disk writer, gRPC's completion-queue poller); over each
  phase's whole run, per request made (connects and warm-ups included in both; a thread
  that ends within a phase, as gRPC's pool may shrink, is left out of it);
- ``host_busy_cpus``: the host's busy CPU seconds (``/proc/stat``: every process) over the
  phases' seconds, out of ``env.cpus``.

Usage: ``python bench/rpc_cpu.py [--phases N] [--requests N] [--out PATH]``; prints one JSON
object. A diagnosis for ``rps_8``, not a criterion: no ratio here is judged.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

WORKERS = 8
WARMUP = 16
SIDES = ("echo", "daemon_commit", "daemon_sync_none")


def thread_cpu_s(pid: int) -> dict[str, tuple[str, float]]:
    """``{tid: (kind, CPU seconds so far)}`` of ``pid``'s threads; kind ``loop`` (the main
    thread), ``event_engine`` (gRPC's I/O threads) or ``other``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended since the listing
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        kind = "loop" if task == str(pid) else "event_engine" if comm.startswith("event_engine") else "other"
        out[task] = (kind, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def cpu_between(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds by kind between two ``thread_cpu_s`` readings: each thread alive at the end
    counts from the first reading (or from its start, when it began since); one that ended
    in between is not counted (gRPC's thread pool may shrink), so no kind goes negative."""
    out = {"loop": 0.0, "event_engine": 0.0, "other": 0.0}
    for tid, (kind, secs) in after.items():
        out[kind] += secs - before.get(tid, (kind, 0.0))[1]
    return out


def host_busy_s() -> float:
    """Busy CPU seconds of the whole host so far (all but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _phase(pid: int, target, args_per_worker: list[tuple], made: int) -> dict:
    from rpc_load import run_workers

    cpu0, busy0, t0 = thread_cpu_s(pid), host_busy_s(), time.monotonic()
    run = run_workers(target, args_per_worker)
    cpu1, busy1, t1 = thread_cpu_s(pid), host_busy_s(), time.monotonic()
    run["server_cpu_s"] = cpu_between(cpu0, cpu1)
    run["made"] = made
    run["busy_s"], run["wall_s"] = busy1 - busy0, t1 - t0
    return run


def _side(runs: list[dict]) -> dict:
    from rpc_load import combine_runs

    made = sum(r["made"] for r in runs)
    server = {k: sum(r["server_cpu_s"][k] for r in runs) / made * 1e6 for k in runs[0]["server_cpu_s"]}
    server["total"] = sum(server.values())
    out = combine_runs(runs)
    return {"rps": out["rps"], "rps_by_run": out["rps_by_run"], "p50_us": out["p50_us"],
            "requests": out["requests"], "client_cpu_us": out["client_cpu_us"],
            "server_cpu_us": {k: round(v, 1) for k, v in server.items()},
            "host_busy_cpus": round(sum(r["busy_s"] for r in runs) / sum(r["wall_s"] for r in runs), 2)}


def run(phases: int, per_worker: int) -> dict:
    from prefixd.tools.workloads import gsp
    from rpc import GSP_LAYOUT, TINY_LAYOUT, _sizes
    from rpc_daemon import BenchDaemon
    from rpc_echo import EchoServer
    from rpc_load import echo_worker, gsp_worker

    n = WARMUP + per_worker
    groups = 64
    prompts = [r.prompt for r in gsp(groups, -(-phases * WORKERS * n // groups), seed=2)]
    sizes = _sizes()
    blocks = (131072, 131072, 262144)  # as bench/rpc.py: no eviction
    runs: dict[str, list] = {side: [] for side in SIDES}
    t_start = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdb-cpu-", dir="/tmp") as tmp, \
            EchoServer(os.path.join(tmp, "echo.sock")) as echo, \
            BenchDaemon(blocks, (TINY_LAYOUT["model_id"], 4096)) as commit, \
            BenchDaemon(blocks, (TINY_LAYOUT["model_id"], 4096), sync="none") as nosync:
        for k in range(phases):
            part = prompts[k * WORKERS * n:(k + 1) * WORKERS * n]
            runs["echo"].append(_phase(echo.proc.pid, echo_worker, [
                (echo.path, (sizes["open"], sizes["release"]), per_worker, WARMUP) for _ in range(WORKERS)],
                WORKERS * n))
            for side, daemon in (("daemon_commit", commit), ("daemon_sync_none", nosync)):
                runs[side].append(_phase(daemon.proc.pid, gsp_worker, [
                    (daemon.socket, GSP_LAYOUT, part[i::WORKERS], WARMUP) for i in range(WORKERS)], WORKERS * n))
        for daemon in (commit, nosync):
            status = daemon.stop()
            if status != 0:
                raise RuntimeError(f"a daemon stopped with status {status}:\n{daemon.log()}")
    import grpc

    sides = {side: _side(r) for side, r in runs.items()}
    return {
        "bench": "rpc_cpu",
        "params": {"workers": WORKERS, "phases": phases, "requests_per_worker_per_phase": per_worker,
                   "warmup_per_worker_per_phase": WARMUP, "gsp_layout": GSP_LAYOUT,
                   "gsp_pool_blocks": dict(zip(("device", "host", "disk"), blocks)),
                   "durability": "crash"},
        "env": {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                "python": platform.python_version(), "grpc": grpc.__version__,
                "seconds": round(time.monotonic() - t_start, 1)},
        "sides": sides,
        "ratios": {
            "commit_rps_over_echo": round(sides["daemon_commit"]["rps"] / sides["echo"]["rps"], 3),
            "sync_none_rps_over_commit": round(sides["daemon_sync_none"]["rps"] / sides["daemon_commit"]["rps"], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=int, default=3, help="alternations of the three sides")
    parser.add_argument("--requests", type=int, default=300, help="measured requests per worker per phase")
    parser.add_argument("--out", metavar="PATH", help="also write the JSON object here")
    args = parser.parse_args(argv)
    if args.phases < 1 or args.requests < 1:
        parser.error("--phases and --requests must be >= 1")
    from rpc import emit_json

    result = run(args.phases, args.requests)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
