"""Request latency as a client sees it while the daemon is healthy, hung and dead, and the
daemon's loop lag during a checkpoint of a 1M-block pool.

Four client processes (the client library, no vLLM) each send gsp requests
(``prefixd.tools.workloads.gsp``: shared system prompts, unique questions) at a fixed pace:
one request is an ``open`` of the prompt and a ``release`` with ``commit`` (durability
"index": the bench is about the daemon answering, not the disk). Each session fails fast
(``request_timeout_ms``, ``prefixd.client.breaker``). A request that raised is a *miss*; its
latency counts like any other. One daemon (``prefixd.tools.daemon_proc``, small pools under a
temporary directory) goes through three phases, each a window of requests by start time:

- ``healthy``: ``--phase-s`` seconds of normal service;
- ``hung``: the daemon SIGSTOPped for ``--stop-s`` seconds, then SIGCONT;
- ``dead``: the daemon SIGKILLed, restarted on the same state at once (its start counted
  inside the window).

A fault's window runs from the signal until every client has had a request answered again
(``recovered_s``: that moment, after the SIGCONT or after the restarted daemon serves): the
fault's whole cost as a client sees it, and nothing of the service after it. ``--tail-s`` of
service follows each fault before the next begins.

For each: ``p50_ms``, ``p99_ms``, ``max_ms``, ``requests``, ``misses``, and ``slow`` (requests
that took at least half the request deadline: with the breaker, about one per client per
outage, the call that missed the deadline and tripped it). ``hung_over_dead_p99``
is the judged ratio (``hung.p99_ms / dead.p99_ms``, at most 1.5).

``checkpoint``: a second daemon over a pool of ``--ckpt-blocks`` (1M) indexed blocks, built
in-process through the engine as ``bench/recovery.py`` builds its state (``fill_disk`` and
``Traffic`` of ``bench/recovery_parts/recovery_state.py``), the four clients running on that
pool, and a Checkpoint rpc (``prefixctl checkpoint``'s). Reported:
``checkpoint_s`` (the rpc's wall time), the clients' latency in the window of the checkpoint,
and ``loop_lag_p99_ms`` / ``loop_lag_max_ms`` from the daemon's Stats
(``prefixd_loop_lag_p99_seconds`` / ``prefixd_loop_lag_max_seconds`` over the last 10 s): null
when the daemon does not export them. The checkpoint starts once the daemon has served for
more than that window, so the lag read covers the checkpoint and its tail, not what follows
the start (with no checkpoint at all, the first 10 s after a start with the 1M-block pool
read p99 64 ms, max 149 ms: the start's own stalls, measured apart from the checkpoint's).

Usage: ``python bench/faults.py --json [--quick] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from prefixd.api.layout import KVLayout  # noqa: E402
from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS  # noqa: E402
from prefixd.tools.daemon_proc import DaemonProc  # noqa: E402

LAYOUT = KVLayout("faults-bench", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=16)
LAG_KEYS = ("prefixd_loop_lag_p99_seconds", "prefixd_loop_lag_max_seconds")
LAG_WINDOW_S = 10.0  # what the daemon's lag gauges span (``prefixd.daemon.loop_lag.WINDOW_S``)


# -- one client process ----------------------------------------------------------------------

def client_main(args: dict) -> None:
    """Requests at ``period_s`` until the stop file appears; writes ``[(start, seconds, ok)]``."""
    import prefixd.client as pc
    from prefixd.tools.workloads import gsp

    layout = KVLayout(**args["layout"])
    reqs = gsp(num_groups=args["groups"], prompts_per_group=8, system_len=args["system_len"],
               question_len=64, output_len=1, seed=args["seed"])
    prompts = [np.frombuffer(r.prompt, dtype="<i4").tolist() for r in reqs]
    records = []
    session = pc.connect(args["socket"], layout, name=f"faults-{args['seed']}", mapped=False,
                         request_timeout_ms=args["request_timeout_ms"], timeout_s=60.0)
    open(args["ready"], "w").close()
    i = 0
    next_at = time.monotonic()
    while not os.path.exists(args["stop"]):
        t0 = time.monotonic()
        ok = True
        try:
            seq = session.open(prompts[i % len(prompts)])
            session.release(seq, commit=True, durability="index")
        except pc.PrefixdError:
            ok = False
        records.append((t0, time.monotonic() - t0, ok, args["seed"]))
        i += 1
        next_at = max(next_at + args["period_s"], time.monotonic())
        time.sleep(max(0.0, next_at - time.monotonic()))
    try:
        session.close()
    except pc.PrefixdError:
        pass
    with open(args["out"], "w") as f:
        json.dump(records, f)


class Clients:
    """``n`` client processes on ``socket``; ``stop()`` returns every record of all of them."""

    def __init__(self, socket: str, layout: KVLayout, n: int, work: str, *, period_s: float,
                 request_timeout_ms: float, groups: int, system_len: int) -> None:
        self.work = work
        self.stop_file = os.path.join(work, "stop")
        self.procs, self.outs = [], []
        for i in range(n):
            out, ready = os.path.join(work, f"client{i}.json"), os.path.join(work, f"ready{i}")
            spec = {"socket": socket, "seed": i, "period_s": period_s, "request_timeout_ms": request_timeout_ms,
                    "groups": groups, "system_len": system_len, "stop": self.stop_file, "out": out,
                    "ready": ready}
            spec["layout"] = {k: getattr(layout, k) for k in
                              ("model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")}
            self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client",
                                                json.dumps(spec)], cwd=ROOT))
            self.outs.append((out, ready))
        deadline = time.monotonic() + 300
        while not all(os.path.exists(r) for _, r in self.outs):
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise RuntimeError("a client did not start (see its stderr)")
            time.sleep(0.05)

    def stop(self) -> list[tuple[float, float, bool, int]]:
        open(self.stop_file, "w").close()
        records = []
        for p, (out, _) in zip(self.procs, self.outs):
            if p.wait(120) != 0:
                raise RuntimeError(f"client exited with {p.returncode}")
            with open(out) as f:
                records.extend(tuple(r) for r in json.load(f))
        return records


def recovered(records, after: float) -> float:
    """When every client had a request answered again after ``after`` (the fault's end): the
    end of the first successful request each client started after it, the latest of them."""
    firsts: dict[int, float] = {}
    for t0, lat, ok, client in sorted(records):
        if ok and t0 >= after and client not in firsts:
            firsts[client] = t0 + lat
    if len(firsts) < len({r[3] for r in records}):
        raise RuntimeError("a client never had a request answered after the fault")
    return max(firsts.values())


def window(records, start: float, end: float, deadline_s: float) -> dict:
    """Latency of the requests in flight at some time of ``[start, end)`` (a request sent just
    before a SIGSTOP is the one that waits for its deadline: it belongs to the fault)."""
    inside = [r for r in records if r[0] < end and r[0] + r[1] >= start]
    lat = np.array([r[1] for r in inside]) * 1000
    misses = sum(1 for r in inside if not r[2])
    slow = sum(1 for r in inside if r[1] >= deadline_s / 2)
    if not len(lat):
        return {"requests": 0, "misses": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "slow": 0}
    return {"requests": int(len(lat)), "misses": int(misses), "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2), "max_ms": round(float(lat.max()), 2),
            "slow": slow}


# -- the fault phases ------------------------------------------------------------------------

def fault_phases(opts, work: str) -> dict:
    with DaemonProc(os.path.join(work, "d"), device=1024, host=2048, disk=4096, lease_s=30.0) as d:
        d.start()
        clients = Clients(d.socket, LAYOUT, opts.clients, work, period_s=opts.period_ms / 1000,
                          request_timeout_ms=opts.request_timeout_ms, groups=4, system_len=opts.system_len)
        try:
            t_healthy = time.monotonic()
            time.sleep(opts.phase_s)
            t_stop = time.monotonic()
            os.kill(d.proc.pid, signal.SIGSTOP)
            time.sleep(opts.stop_s)
            os.kill(d.proc.pid, signal.SIGCONT)
            t_cont = time.monotonic()
            time.sleep(opts.tail_s)
            t_kill = time.monotonic()
            d.kill9()
            restart_s = d.start()
            t_served = time.monotonic()
            time.sleep(opts.tail_s)
            t_end = time.monotonic()
        finally:
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
            records = clients.stop()
        d.stop()
    dl = opts.request_timeout_ms / 1000
    hung_end, dead_end = recovered(records, t_cont), recovered(records, t_served)
    return {"healthy": window(records, t_healthy, t_stop, dl),
            "hung": {**window(records, t_stop, hung_end, dl), "stopped_s": round(t_cont - t_stop, 2),
                     "recovered_s": round(hung_end - t_cont, 3)},
            "dead": {**window(records, t_kill, dead_end, dl), "restart_s": round(restart_s, 2),
                     "recovered_s": round(dead_end - t_served, 3)},
            "_end": t_end}


# -- the checkpoint phase --------------------------------------------------------------------

def build_pool(d: DaemonProc, n: int) -> dict:
    """Fill the daemon's pool of ``recovery_state.LAYOUT`` with ``n`` indexed disk blocks through
    the engine itself (so manifest and tenant salt are the daemon's), then checkpoint and close."""
    import recovery_state
    from prefixd.config import load
    from prefixd.engine.engine import Engine

    engine_config, _ = load(d.config_path)
    t0 = time.perf_counter()
    engine = Engine(d.state_dir, engine_config)
    try:
        dc = engine.pool("default", recovery_state.LAYOUT)
        recovery_state.fill_disk(dc, recovery_state.Traffic(0, num_systems=max(8, n // 5000)), n)
        engine.checkpoint()
        blocks = list(dc.cache.tree.num_blocks_in)
    finally:
        engine.close()
    return {"build_s": round(time.perf_counter() - t0, 1), "blocks_by_tier": blocks}


def checkpoint_phase(opts, work: str) -> dict:
    import grpc

    import recovery_state
    from prefixd.api import prefixd_pb2 as pb
    from prefixd.api import prefixd_pb2_grpc as pb_grpc

    disk = opts.ckpt_blocks + max(opts.ckpt_blocks // 20, 2000)
    with DaemonProc(os.path.join(work, "c"), device=recovery_state.DEVICE_BLOCKS,
                    host=recovery_state.HOST_BLOCKS, disk=disk, lease_s=30.0) as d:
        built = build_pool(d, opts.ckpt_blocks)
        d.start(timeout=600)
        serving = time.monotonic()
        os.makedirs(os.path.join(work, "cc"))
        clients = Clients(d.socket, recovery_state.LAYOUT, opts.clients, os.path.join(work, "cc"),
                          period_s=opts.period_ms / 1000, request_timeout_ms=opts.request_timeout_ms,
                          groups=4, system_len=opts.system_len)
        lag = dict.fromkeys(LAG_KEYS)
        try:
            # the lag window (10 s) past the start's one-time work before the checkpoint
            time.sleep(max(opts.tail_s, LAG_WINDOW_S + 0.5 - (time.monotonic() - serving)))
            with grpc.insecure_channel("unix:" + d.socket) as ch:
                stub = pb_grpc.PrefixCacheStub(ch)
                t0 = time.monotonic()
                stub.Checkpoint(pb.CheckpointRequest(), timeout=600)
                t1 = time.monotonic()
                time.sleep(opts.tail_s)
                values = dict(stub.Stats(pb.StatsRequest(session_id=0), timeout=30).values)
            for key in LAG_KEYS:
                hits = [v for k, v in values.items() if k == key or k.startswith(key + "{")]
                lag[key] = max(hits) if hits else None
        finally:
            records = clients.stop()
        d.stop()
    ms = {k: (round(v * 1000, 2) if v is not None else None) for k, v in lag.items()}
    return {"blocks": opts.ckpt_blocks, **built, "checkpoint_s": round(t1 - t0, 3),
            "requests_during": window(records, t0, t1 + 0.5, opts.request_timeout_ms / 1000),
            "loop_lag_p99_ms": ms[LAG_KEYS[0]], "loop_lag_max_ms": ms[LAG_KEYS[1]],
            "loop_lag_exported": lag[LAG_KEYS[0]] is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--period-ms", type=float, default=20.0, help="each client's pace")
    ap.add_argument("--request-timeout-ms", type=float, default=DEFAULT_REQUEST_TIMEOUT_MS)
    ap.add_argument("--phase-s", type=float, default=10.0, help="healthy window")
    ap.add_argument("--stop-s", type=float, default=5.0, help="how long the daemon stays SIGSTOPped")
    ap.add_argument("--tail-s", type=float, default=2.0, help="window kept after a fault ends")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--ckpt-blocks", type=int, default=1_000_000, help="0 skips the checkpoint phase")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.client:
        client_main(json.loads(opts.client))
        return 0
    if opts.quick:
        opts.phase_s, opts.stop_s, opts.tail_s = 3.0, 2.0, 1.5
        opts.ckpt_blocks = min(opts.ckpt_blocks, 20_000) if opts.ckpt_blocks else 0
        opts.system_len = 128
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "recovery_parts"))  # the checkpoint phase's pool and traffic
    work = tempfile.mkdtemp(prefix="pdf-", dir="/tmp")
    result = {"bench": "faults", "params": {k: v for k, v in vars(opts).items() if k not in ("client", "out")}}
    phases = fault_phases(opts, work)
    phases.pop("_end")
    result.update(phases)
    h, dd = result["hung"]["p99_ms"], result["dead"]["p99_ms"]
    result["hung_over_dead_p99"] = round(h / dd, 3) if h and dd else None
    if opts.ckpt_blocks:
        result["checkpoint"] = checkpoint_phase(opts, work)
        result["loop_lag_p99_ms"] = result["checkpoint"]["loop_lag_p99_ms"]
    else:
        result["loop_lag_p99_ms"] = None
    result["host_load"] = round(os.getloadavg()[0], 2)
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
