"""The loops ``bench/rpc.py`` times: gsp requests through the client library, and the floor's
echo pairs and LMDB commits; each as a plain function (the one-client rounds) and as a worker
process body (the 8-client runs, forked from a ``multiprocessing`` forkserver and released
together by a barrier once every worker has connected and warmed up).

A gsp request here is what `bench/rpc.py` times: ``open`` of the prompt (2,176 tokens), then
``release`` with commit at durability ``crash`` (the reply waits for the WAL fsync).
"""

from __future__ import annotations

import resource
import struct
import time

import lmdb

_KEY = struct.Struct(">Q")


def gsp_requests(session, prompts: list[bytes], opens: list[int] | None = None) -> list[int]:
    """Each prompt as one request; returns each request's nanoseconds (and appends the
    ``open`` part of each to ``opens`` when given)."""
    clock = time.perf_counter_ns
    out = []
    for prompt in prompts:
        t0 = clock()
        seq = session.open(prompt)
        t1 = clock()
        session.release(seq, commit=True, durability="crash")
        out.append(clock() - t0)
        if opens is not None:
            opens.append(t1 - t0)
    return out


class LmdbCommit:
    """The floor's durable commit: one put of ``value_bytes`` (plus an 8-byte key, as the WAL's)
    in a write transaction of an environment with the WAL's flags (sync and metasync on)."""

    def __init__(self, path: str, value_bytes: int) -> None:
        from prefixd.wal.env import MAX_DBS

        self.env = lmdb.open(path, map_size=1 << 30, max_dbs=MAX_DBS, sync=True, metasync=True,
                             lock=True)
        self.db = self.env.open_db(b"log")
        self.value = b"\x5a" * value_bytes
        self.lsn = 0

    def commit(self) -> None:
        self.lsn += 1
        with self.env.begin(write=True, db=self.db) as txn:
            txn.put(_KEY.pack(self.lsn), self.value, append=True)

    def close(self) -> None:
        self.env.close()


def floor_requests(echo, open_req: bytes, release_req: bytes, lmdb_commit, n: int,
                   echoes: list[int] | None = None) -> list[int]:
    """``n`` floor requests: an echo of Open's sizes, an echo of Release's, and (when
    ``lmdb_commit``) one durable LMDB commit; returns each one's nanoseconds (and appends the
    echo pair's part of each to ``echoes`` when given)."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        echo.call(open_req)
        echo.call(release_req)
        t1 = clock()
        if lmdb_commit is not None:
            lmdb_commit.commit()
        out.append(clock() - t0)
        if echoes is not None:
            echoes.append(t1 - t0)
    return out


# -- worker processes (8 clients) ----------------------------------------------------------------

def gsp_worker(socket_path: str, layout_fields: dict, prompts: list[bytes], warmup: int,
               barrier, results) -> None:
    """A client process: connect, ``warmup`` requests, wait at ``barrier``, then the rest."""
    import prefixd.client as pc

    try:
        layout = pc.KVLayout(**layout_fields)
        with pc.connect(socket_path, layout, name="bench-rpc-worker") as session:
            gsp_requests(session, prompts[:warmup])
            barrier.wait()
            t0, cpu0 = time.monotonic(), _cpu_s()
            lat = gsp_requests(session, prompts[warmup:])
            t1, cpu1 = time.monotonic(), _cpu_s()
        results.put(("ok", len(lat), t0, t1, lat, cpu1 - cpu0))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        results.put(("error", repr(exc)))


def echo_worker(socket_path: str, request_sizes: tuple[tuple[int, int], tuple[int, int]], n: int,
                warmup: int, barrier, results) -> None:
    """A floor client process: ``n`` echo pairs of the Open and Release sizes after ``warmup``."""
    from rpc_echo import EchoClient

    try:
        echo = EchoClient(socket_path)
        open_req, release_req = (echo.request(*sizes) for sizes in request_sizes)
        floor_requests(echo, open_req, release_req, None, warmup)
        barrier.wait()
        t0, cpu0 = time.monotonic(), _cpu_s()
        lat = floor_requests(echo, open_req, release_req, None, n)
        t1, cpu1 = time.monotonic(), _cpu_s()
        echo.close()
        results.put(("ok", len(lat), t0, t1, lat, cpu1 - cpu0))
    except BaseException as exc:  # noqa: BLE001
        barrier.abort()
        results.put(("error", repr(exc)))


def _cpu_s() -> float:
    """This process's CPU seconds so far (user + system, every thread: gRPC's own too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _context():
    """A forkserver that has imported the client library (and torch) once: 8 workers forked
    from it start at once, where 8 spawned interpreters each importing torch took a minute on
    a busy 2-core host. The forkserver starts clean (no gRPC channel or thread to inherit)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rpc_load", "rpc_echo", "prefixd.client"])
    return ctx


def run_workers(target, args_per_worker: list[tuple], timeout: float = 600.0) -> dict:
    """Start one worker process per args tuple, release them together, and return
    ``{"requests", "seconds", "rps", "p50_us", "p99_us", "client_cpu_us", "latencies_ns"}`` of
    all of them (``client_cpu_us``: the workers' CPU per request while measured;
    ``latencies_ns`` sorted: for ``combine_runs``, not for the JSON)."""
    ctx = _context()
    barrier = ctx.Barrier(len(args_per_worker))
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results), daemon=True)
             for args in args_per_worker]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [g[1] for g in got if g[0] != "ok"]
    if errors:
        raise RuntimeError(f"a worker failed: {errors}")
    seconds = max(g[3] for g in got) - min(g[2] for g in got)
    requests = sum(g[1] for g in got)
    return _summary(requests, seconds, [x for g in got for x in g[4]],
                    client_cpu_us=round(sum(g[5] for g in got) / requests * 1e6, 1))


def combine_runs(runs: list[dict]) -> dict:
    """``run_workers``' results of several runs of one side as one: all requests over all
    measured seconds, the percentiles of every request's latency, and each run's rate."""
    requests = sum(r["requests"] for r in runs)
    cpu_us = sum(r["client_cpu_us"] * r["requests"] for r in runs)
    out = _summary(requests, sum(r["seconds"] for r in runs),
                   [x for r in runs for x in r["latencies_ns"]], rps_by_run=[r["rps"] for r in runs],
                   client_cpu_us=round(cpu_us / requests, 1))
    del out["latencies_ns"]
    return out


def _summary(requests: int, seconds: float, latencies_ns: list[int], **extra) -> dict:
    lat = sorted(latencies_ns)
    return {"requests": requests, "seconds": round(seconds, 3), "rps": round(requests / seconds, 1),
            "p50_us": round(lat[len(lat) // 2] / 1000, 1),
            "p99_us": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] / 1000, 1), **extra,
            "latencies_ns": lat}
