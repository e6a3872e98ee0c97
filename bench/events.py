"""KV events on ZMQ: what publishing them costs the daemon, and how late a router sees a commit.

Two ``prefixd serve`` processes on fresh state (pools in ``/dev/shm``), the same but for
``[daemon.kv_events]``: one publishes (PUB + replay ROUTER on ``ipc://``, a subscriber reading
every batch on a thread of this process), one does not. A round is one phase of each, off then
publish, on fresh prompts, each phase followed by a pause (``SETTLE_S``): phases alternate
(off, publish, off, ...), each after the other side's, so that the host's noise lands on both
and a round's two phases share the host's state. A phase is 8 client processes
(``prefixd.client``) doing gsp requests together: ``open`` of the prompt (a shared 512-token
system prompt + a unique 64-token question), then ``release`` with commit at durability
``crash``. Layout ``bench-events``: 1 layer x 1 KV head x head dim 8, fp16, block 16 (512-byte
blocks, as ``bench/rpc.py``), tiers device / host / disk small enough that blocks are
evicted and demoted (so every event kind flows). Prints one JSON object:

- ``off.per_request_us`` / ``publish.per_request_us``: the median over the rounds of a phase's
  measured seconds over its requests (all 8 clients together), in microseconds (each round's
  in ``per_request_us_by_round``; ``mean_per_request_us``: all seconds over all requests);
  ``ratio`` = publish / off of those medians; ``ratio_by_round``: each round's publish / off,
  and ``ratio_paired_median`` their median (a round's phases share the host's load, so this
  one is the least disturbed by its drift);
- ``*.daemon_cpu_us_per_request``: the daemon process's CPU (every thread) per request of a
  phase, warm-up included (the median over the rounds); ``publish.loop_us_per_request``: the
  loop's time in the publisher (``prefixd_kv_events_loop_seconds``) per request;
  ``loop_share``: that over the daemon's CPU per request without publishing (the cost on the
  hot path, free of the host's noise);
- ``events_per_s``, ``batches_per_s``: what the subscriber received per second of the
  publishing phases; ``dropped_batches``: what the daemon counted dropped (0 expected);
- ``lag_p50_ms`` / ``lag_p99_ms``: from a commit's acknowledgment (``release`` returned in
  the client) to the subscriber's receipt of the ``BlockStored`` of that prompt's last full
  block (wall clock of one host; a batch that arrives before the reply counts 0, and
  ``received_before_ack`` is the fraction that did).

Usage: ``python bench/events.py --json [--rounds N] [--requests N] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from prefixd.tools.daemon_proc import DaemonProc  # noqa: E402

BS = 16
CLIENTS = 8
# NOTE: a pause after every phase, so that the daemon's work behind it (write-behind to disk, a
# checkpoint) does not run into the other side's phase: with the order swapped every round
# (off-publish, publish-off) and no pause, the phase that followed its own side's ran slower,
# and the rounds' publish / off alternated 0.4-0.85 / 1.2-1.44 (10 rounds, host load 8-11)
SETTLE_S = 1.0
SYSTEM, QUESTION = 512, 64
LAYOUT = dict(model_id="bench-events", num_layers=1, num_kv_heads=1, head_dim=8,
              dtype="float16", block_size=BS)
CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"

[engine.blocks]
device = 2048
host = 4096
disk = 8192

[daemon]
lease_s = 30.0
{kv}
"""
KV = """
[daemon.kv_events]
endpoint = "ipc://{base}/kv"
replay_endpoint = "ipc://{base}/kvr"
"""


class Subscriber:
    """Reads every batch of ``endpoint`` on a thread, keeping ``(receipt time, seq, payload)``;
    ``drain`` decodes what came (between phases: the router's work stays off the measured
    seconds, which share two cores with it), keeping the receipt time of each ``BlockStored``
    on the GPU by its last block's token ids."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.raw: list = []
        self.events = self.batches = 0
        self.seen: dict[bytes, float] = {}
        self.last_seq = None
        self.gaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock, clock, keep = self.sock, time.time, self.raw.append
        while not self._stop.is_set():
            if sock.poll(50):
                _, seq_b, payload = sock.recv_multipart()
                keep((clock(), seq_b, payload))

    def drain(self) -> None:
        raw, self.raw[:] = list(self.raw), []
        for now, seq_b, payload in raw:
            seq = int.from_bytes(seq_b, "big")
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = seq
            _, events, _ = msgpack.unpackb(payload)
            self.batches += 1
            self.events += len(events)
            for e in events:
                if e["type"] == "BlockStored" and e["medium"] == "GPU" and e["token_ids"]:
                    key = np.asarray(e["token_ids"][-BS:], dtype="<i4").tobytes()
                    self.seen.setdefault(key, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system, every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(socket_path: str, prompts: list[bytes], warmup: int, barrier, results) -> None:
    """A client: ``warmup`` requests, the barrier, then the rest; reports its window and, per
    request, the last full block's tokens and the wall time its commit was acknowledged."""
    import prefixd.client as pc

    try:
        with pc.connect(socket_path, pc.KVLayout(**LAYOUT), name="bench-events") as s:
            for p in prompts[:warmup]:
                s.release(s.open(p), commit=True, durability="crash")
            barrier.wait()
            acks = []
            t0 = time.monotonic()
            for p in prompts[warmup:]:
                s.release(s.open(p), commit=True, durability="crash")
                full = len(p) // (4 * BS) * 4 * BS
                acks.append((p[full - 4 * BS:full], time.time()))
            t1 = time.monotonic()
        results.put(("ok", t0, t1, acks))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        results.put(("error", repr(exc)))


def phase(ctx, socket_path: str, rng, requests: int, warmup: int, system: np.ndarray) -> dict:
    barrier = ctx.Barrier(CLIENTS)
    results = ctx.Queue()
    procs = []
    for _ in range(CLIENTS):
        prompts = [np.concatenate([system, rng.integers(0, 50000, QUESTION, dtype="<i4")])
                   .astype("<i4").tobytes() for _ in range(warmup + requests)]
        procs.append(ctx.Process(target=worker, args=(socket_path, prompts, warmup, barrier,
                                                      results), daemon=True))
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [g[1] for g in got if g[0] != "ok"]
    if errors:
        raise RuntimeError(f"a client failed: {errors}")
    t0, t1 = min(g[1] for g in got), max(g[2] for g in got)
    return {"seconds": t1 - t0, "requests": CLIENTS * requests, "warmup_share": warmup / requests,
            "acks": [a for g in got for a in g[3]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=8, help="rounds (a phase of each side)")
    ap.add_argument("--requests", type=int, default=150, help="per client per phase")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["prefixd.client"])
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50000, SYSTEM, dtype="<i4")
    shm = tempfile.mkdtemp(prefix="pd-bench-ev-", dir="/dev/shm")
    daemons = {}
    sub = None
    try:
        for side in ("off", "publish"):
            base = tempfile.mkdtemp(prefix="pdev-", dir="/tmp")
            d = DaemonProc(base, config=CONFIG.format(shm="{shm}", kv=KV if side == "publish"
                                                      else "").replace("{base}", base),
                           shm_dir=os.path.join(shm, side))
            os.makedirs(d.shm_dir, exist_ok=True)
            d.start(120.0)
            daemons[side] = d
        sub = Subscriber(f"ipc://{daemons['publish'].base}/kv")
        time.sleep(0.5)  # the subscription reaches the publisher
        runs = {"off": [], "publish": []}
        lags = []
        for _ in range(args.rounds):
            for side in ("off", "publish"):
                d = daemons[side]
                cpu0, loop0 = cpu_s(d.pid()), _loop_s(d) if side == "publish" else 0.0
                r = phase(ctx, d.socket, rng, args.requests, args.warmup, system)
                r["daemon_cpu_s"] = cpu_s(d.pid()) - cpu0
                runs[side].append(r)
                time.sleep(SETTLE_S)  # the daemon's work behind the phase ends off the next one
                if side == "publish":
                    r["loop_s"] = _loop_s(d) - loop0
                    sub.drain()
                    for key, t_ack in r.pop("acks"):
                        t_recv = sub.seen.get(key)
                        if t_recv is not None:
                            lags.append(t_recv - t_ack)
        out = summary(runs, lags, sub, daemons["publish"])
    finally:
        if sub is not None:
            sub.close()
        for d in daemons.values():
            d.stop(120.0)
            d.close()
        shutil.rmtree(shm, ignore_errors=True)
    text = json.dumps(out, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text if args.json else f"publish/off {out['ratio']} lag p99 {out['lag_p99_ms']} ms")
    return out


def summary(runs: dict, lags: list[float], sub: Subscriber, pub_daemon) -> dict:
    def side(rs):
        per = [r["seconds"] / r["requests"] * 1e6 for r in rs]
        cpu = [r["daemon_cpu_s"] / (r["requests"] * (1 + r.get("warmup_share", 0))) * 1e6
               for r in rs]
        seconds, requests = sum(r["seconds"] for r in rs), sum(r["requests"] for r in rs)
        return {"per_request_us": round(statistics.median(per), 1),
                "mean_per_request_us": round(seconds / requests * 1e6, 1),
                "rps": round(requests / seconds, 1), "requests": requests,
                "daemon_cpu_us_per_request": round(statistics.median(cpu), 1),
                "per_request_us_by_round": [round(x, 1) for x in per]}

    off, pub = side(runs["off"]), side(runs["publish"])
    pub_requests = sum(r["requests"] * (1 + r.get("warmup_share", 0)) for r in runs["publish"])
    pub["loop_us_per_request"] = round(sum(r["loop_s"] for r in runs["publish"]) / pub_requests
                                       * 1e6, 1)
    pub_seconds = sum(r["seconds"] for r in runs["publish"])
    by_round = [p / o for p, o in zip(pub["per_request_us_by_round"],
                                      off["per_request_us_by_round"])]
    early = sum(x < 0 for x in lags) / len(lags) if lags else None
    lags = sorted(max(0.0, x) for x in lags)
    stats = _stats(pub_daemon)
    return {
        "off": off, "publish": pub,
        "ratio": round(pub["per_request_us"] / off["per_request_us"], 3),
        "ratio_paired_median": round(statistics.median(by_round), 3),
        "ratio_by_round": [round(x, 3) for x in by_round],
        "rounds": len(by_round),
        "loop_share": round(pub["loop_us_per_request"] / off["daemon_cpu_us_per_request"], 4),
        "events_per_s": round(sub.events / pub_seconds, 1),
        "batches_per_s": round(sub.batches / pub_seconds, 1),
        "lag_p50_ms": round(lags[len(lags) // 2] * 1e3, 2) if lags else None,
        "lag_p99_ms": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1e3, 2)
        if lags else None,
        "lag_samples": len(lags), "received_before_ack": round(early, 3) if lags else None,
        "subscriber_gaps": sub.gaps,
        "dropped_batches": stats.get("prefixd_kv_events_dropped_batches_total"),
        "clients": CLIENTS, "prompt_tokens": SYSTEM + QUESTION, "block_size": BS,
        "host": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
                 "python": platform.python_version()},
    }


def _loop_s(d) -> float:
    return _stats(d).get("prefixd_kv_events_loop_seconds_total", 0.0)


def _stats(d) -> dict:
    import prefixd.client as pc

    with pc.connect(d.socket, pc.KVLayout(**LAYOUT), name="bench-events-stats") as s:
        return s.stats()


if __name__ == "__main__":
    main()
