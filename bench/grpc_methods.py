"""What registering each method costs a grpc.aio server: the daemon's registration
(``handlers.add_service``, generic handlers only) against the generated code's (every method
registered too), one call at a time.

Two server processes run side by side on Unix sockets, each with the ``PrefixCache`` service
(a servicer that answers every rpc with its empty reply) and health checking, the daemon's way
and the generated way. A client calls ``Open`` with a gsp request's size (2,176 tokens) in
alternated repetitions; each server reports its process CPU around each repetition.

- ``server_cpu_us``: the server process's CPU per call (median over repetitions), both ways;
- ``wall_us``: the client's time per call;
- ``cpu_ratio``: generic-only over registered (< 1: the daemon's way costs less).

Run: ``python bench/grpc_methods.py --json [--calls N] [--reps N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSP_TOKENS = 2176
MODES = ("generic", "registered")


def serve(path: str, mode: str) -> None:
    """A server process: serve until stdin closes; each line read answers its process CPU."""
    import grpc
    import uvloop
    from grpc_health.v1 import health, health_pb2_grpc

    from prefixd.api import prefixd_pb2 as pb
    from prefixd.daemon.handlers import GenericOnly, add_service

    class Servicer:
        def __getattr__(self, name):
            reply = getattr(pb, pb.DESCRIPTOR.services_by_name["PrefixCache"]
                            .methods_by_name[name].output_type.name)

            async def behaviour(request, context):
                return reply()
            return behaviour

    async def main() -> None:
        server = grpc.aio.server(maximum_concurrent_rpcs=256)
        registered = mode == "registered"
        add_service(Servicer(), server, registered=registered)
        health_pb2_grpc.add_HealthServicer_to_server(
            health.aio.HealthServicer(), server if registered else GenericOnly(server))
        server.add_insecure_port("unix:" + path)
        await server.start()
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(time.process_time(), flush=True)
        await server.stop(None)

    uvloop.run(main())


class Server:
    def __init__(self, path: str, mode: str) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", path, mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=ROOT))
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{mode} server did not start")

    def cpu_s(self) -> float:
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def calls(path: str, n: int) -> float:
    """``n`` Open calls; returns the seconds they took."""
    import grpc

    from prefixd.api import prefixd_pb2 as pb
    with grpc.insecure_channel("unix:" + path) as ch:
        open_ = ch.unary_unary("/prefixd.v1.PrefixCache/Open",
                               request_serializer=pb.OpenRequest.SerializeToString,
                               response_deserializer=pb.OpenReply.FromString)
        request = pb.OpenRequest(session_id=1, tokens=bytes(4 * GSP_TOKENS))
        open_(request, timeout=10)
        t0 = time.perf_counter()
        for _ in range(n):
            open_(request, timeout=10)
        return time.perf_counter() - t0


def run(n: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="grpc-methods-") as tmp:
        servers = {mode: Server(os.path.join(tmp, mode + ".sock"), mode) for mode in MODES}
        try:
            for server in servers.values():
                calls(server.path, n // 4)  # warm-up
            cpu = {mode: [] for mode in MODES}
            wall = {mode: [] for mode in MODES}
            for rep in range(reps):
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    server = servers[mode]
                    c0 = server.cpu_s()
                    seconds = calls(server.path, n)
                    cpu[mode].append(round((server.cpu_s() - c0) / n * 1e6, 1))
                    wall[mode].append(round(seconds / n * 1e6, 1))
        finally:
            for server in servers.values():
                server.close()
    med = {mode: round(statistics.median(cpu[mode]), 1) for mode in MODES}
    return {
        "bench": "grpc_methods",
        "params": {"calls_per_rep": n, "reps": reps, "request_bytes": 4 * GSP_TOKENS + 4,
                   "order": "alternated each repetition"},
        "env": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "server_cpu_us": {mode: {"median": med[mode], "by_rep": cpu[mode]} for mode in MODES},
        "wall_us": {mode: {"median": round(statistics.median(wall[mode]), 1), "by_rep": wall[mode]}
                    for mode in MODES},
        "cpu_ratio": round(med["generic"] / med["registered"], 3),
        "reps_generic_cheaper": sum(g < r for g, r in zip(cpu["generic"], cpu["registered"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--calls", type=int, default=3000, help="calls per repetition")
    parser.add_argument("--reps", type=int, default=6, help="repetitions per mode")
    parser.add_argument("--out", help="also write the JSON object here")
    parser.add_argument("--serve", nargs=2, metavar=("SOCKET", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(*args.serve)
    result = run(args.calls, args.reps)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text if args.json else f"server CPU per call: generic {result['server_cpu_us']['generic']['median']} us, "
          f"registered {result['server_cpu_us']['registered']['median']} us "
          f"(ratio {result['cpu_ratio']})")


if __name__ == "__main__":
    main()
