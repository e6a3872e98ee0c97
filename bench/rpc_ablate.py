"""Where ``bench/rpc.py``'s gsp request loses against the floor, found by taking parts out.

Four servers, each its own process on a Unix socket in one ``/tmp`` directory, measured in
one run (a diagnosis, not a criterion: no ratio here is judged):

- ``echo``: the floor's bare echo server (``rpc_echo.py``), echo pairs of Open's and
  Release's message sizes, as ``bench/rpc.py``'s ``floor.rps_8``;
- ``daemon``: the daemon as ``bench/rpc.py`` runs it (``sync = "commit"``, release with
  commit at ``crash``);
- ``no_engine``: the same daemon with Open and Release answered without the engine
  (``rpc_ablate_daemon.py``, ``PREFIXD_ABLATE=engine``): its gRPC serving alone;
- ``no_wait``: the daemon with every release at durability ``index``
  (``PREFIXD_ABLATE=wait``): the engine's and the committer's work, but no reply waits for
  an fsync.

Per side: ``rps_8`` (8 client processes, ``--phases`` alternations of the four sides, each
phase with the same fresh prompts for every daemon), and one client's ``p50_us`` of a request
(``--rounds`` alternations; for the daemons also ``open_p50_us``, ``release_p50_us``), and for
the daemons ``log_records`` (records in the pool's WAL at the end: none for ``no_engine``).
``ratios``: each side's ``rps_8`` and ``p50_us`` over ``echo``'s.

Usage: ``python bench/rpc_ablate.py [--phases N] [--requests N] [--rounds N] [--out PATH]``;
prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

WORKERS = 8
WARMUP = 16
DAEMONS = {"daemon": None, "no_engine": "engine", "no_wait": "wait"}  # side -> PREFIXD_ABLATE
SIDES = ("echo", *DAEMONS)


def _us(ns: list[int]) -> float:
    return round(statistics.median(ns) / 1000, 1)


def eight_clients(servers: dict, prompts: list[bytes], phases: int, per_worker: int) -> dict:
    """``rps_8`` of every side, the sides alternating phase by phase (order rotated)."""
    from rpc import GSP_LAYOUT, _sizes
    from rpc_load import combine_runs, echo_worker, gsp_worker, run_workers

    sizes = _sizes()
    n = WARMUP + per_worker
    runs: dict[str, list] = {side: [] for side in SIDES}
    for k in range(phases):
        part = prompts[k * WORKERS * n:(k + 1) * WORKERS * n]
        for side in SIDES[k % len(SIDES):] + SIDES[:k % len(SIDES)]:
            if side == "echo":
                args = [(servers[side].path, (sizes["open"], sizes["release"]), per_worker, WARMUP)
                        for _ in range(WORKERS)]
                runs[side].append(run_workers(echo_worker, args))
            else:
                args = [(servers[side].socket, GSP_LAYOUT, part[i::WORKERS], WARMUP) for i in range(WORKERS)]
                runs[side].append(run_workers(gsp_worker, args))
    out = {}
    for side, r in runs.items():
        c = combine_runs(r)
        out[side] = {"rps": c["rps"], "rps_by_run": c["rps_by_run"], "p50_us": c["p50_us"],
                     "client_cpu_us": c["client_cpu_us"]}
    return out


def one_client(servers: dict, prompts: list[bytes], rounds: int, per_round: int) -> dict:
    """One client's request latency on every side, alternating rounds."""
    import prefixd.client as pc
    from rpc import GSP_LAYOUT, _sizes
    from rpc_echo import EchoClient
    from rpc_load import floor_requests, gsp_requests

    sizes = _sizes()
    echo = EchoClient(servers["echo"].path)
    echo.wait_ready()
    open_req, release_req = echo.request(*sizes["open"]), echo.request(*sizes["release"])
    sessions = {side: pc.connect(servers[side].socket, pc.KVLayout(**GSP_LAYOUT), name="bench-ablate")
                for side in DAEMONS}
    total = {side: [] for side in SIDES}
    opens = {side: [] for side in DAEMONS}
    try:
        warm = prompts[:per_round]
        for side, session in sessions.items():
            gsp_requests(session, warm)
        floor_requests(echo, open_req, release_req, None, per_round)
        for r in range(rounds):
            part = prompts[(r + 1) * per_round:(r + 2) * per_round]
            for side, session in sessions.items():
                total[side] += gsp_requests(session, part, opens[side])
            total["echo"] += floor_requests(echo, open_req, release_req, None, len(part))
    finally:
        for session in sessions.values():
            session.close()
        echo.close()
    out = {"echo": {"p50_us": _us(total["echo"])}}
    for side in DAEMONS:
        out[side] = {"p50_us": _us(total[side]), "open_p50_us": _us(opens[side]),
                     "release_p50_us": _us([a - b for a, b in zip(total[side], opens[side])])}
    return out


def run(phases: int, per_worker: int, rounds: int) -> dict:
    from prefixd.tools.workloads import gsp
    from rpc import GSP_LAYOUT, TINY_LAYOUT
    from rpc_daemon import BenchDaemon
    from rpc_echo import EchoServer

    per_round = 30
    prompts1 = [r.prompt for r in gsp(64, -(-(rounds + 1) * per_round // 64), seed=3)]
    n = WARMUP + per_worker
    prompts8 = [r.prompt for r in gsp(64, -(-phases * WORKERS * n // 64), seed=2)]
    blocks = (131072, 131072, 262144)  # as bench/rpc.py: no eviction
    t_start = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdb-ablate-", dir="/tmp") as tmp:
        servers: dict = {"echo": EchoServer(os.path.join(tmp, "echo.sock"))}
        for side, what in DAEMONS.items():
            entry = [str(BENCH / "rpc_ablate_daemon.py")] if what else None
            servers[side] = BenchDaemon(blocks, (TINY_LAYOUT["model_id"], 4096), entry=entry,
                                        env={"PREFIXD_ABLATE": what} if what else None)
        try:
            for server in servers.values():
                server.__enter__()
            one = one_client(servers, prompts1, rounds, per_round)
            eight = eight_clients(servers, prompts8, phases, per_worker)
            records = {side: servers[side].last_lsn(GSP_LAYOUT["model_id"]) for side in DAEMONS}
            for side in DAEMONS:
                status = servers[side].stop()
                if status != 0:
                    raise RuntimeError(f"daemon {side} stopped with status {status}:\n{servers[side].log()}")
        finally:
            for server in servers.values():
                server.__exit__(None, None, None)
    import grpc

    sides = {side: {"rps_8": eight[side]["rps"], "rps_8_by_run": eight[side]["rps_by_run"],
                    "p50_us_8": eight[side]["p50_us"], "client_cpu_us_8": eight[side]["client_cpu_us"],
                    **one[side]} for side in SIDES}
    for side in DAEMONS:
        sides[side]["log_records"] = records[side]
    echo = sides["echo"]
    return {
        "bench": "rpc_ablate",
        "params": {"workers": WORKERS, "phases": phases, "requests_per_worker_per_phase": per_worker,
                   "warmup_per_worker_per_phase": WARMUP, "one_client_rounds": rounds,
                   "one_client_requests_per_round": per_round, "gsp_layout": GSP_LAYOUT,
                   "durability": "crash", "sync": "commit"},
        "env": {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                "python": platform.python_version(), "grpc": grpc.__version__,
                "seconds": round(time.monotonic() - t_start, 1)},
        "sides": sides,
        "ratios": {side: {"rps_8_over_echo": round(sides[side]["rps_8"] / echo["rps_8"], 3),
                          "p50_over_echo": round(sides[side]["p50_us"] / echo["p50_us"], 3)}
                   for side in DAEMONS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=int, default=4, help="8-client alternations of the four sides")
    parser.add_argument("--requests", type=int, default=100, help="measured requests per worker per phase")
    parser.add_argument("--rounds", type=int, default=16, help="one-client alternations (30 requests each)")
    parser.add_argument("--out", metavar="PATH", help="also write the JSON object here")
    args = parser.parse_args(argv)
    if min(args.phases, args.requests, args.rounds) < 1:
        parser.error("--phases, --requests and --rounds must be >= 1")
    from rpc import emit_json

    result = run(args.phases, args.requests, args.rounds)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
