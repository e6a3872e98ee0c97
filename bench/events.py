"""KV events on ZMQ: what publishing them costs the daemon, and how late a router sees a commit.

Two ``prefixd serve`` processes on fresh state (pools in ``/dev/shm``), the same but for
``[daemon.kv_events]``: one publishes (PUB + replay ROUTER on ``ipc://``, a subscriber reading
every batch on a thread of this process), one does not. A round runs both AT ONCE, so that
the host's noise lands on both alike: 8 client processes (``prefixd.client``) per daemon, the
same prompts to each (client ``i`` of either side draws from seed ``i``), connected and warmed
up once; then, round after round, all 16 pass one barrier and each does gsp requests for the
same ``--seconds``: ``open`` of the prompt (a shared 512-token system prompt + a unique
64-token question), then ``release`` with commit at durability ``crash``. A pause
(``SETTLE_S``) follows each round. Layout ``bench-events``: 1 layer x 1 KV
head x head dim 8, fp16, block 16 (512-byte blocks, as ``bench/rpc.py``), tiers device / host
/ disk small enough that blocks are evicted and demoted (so every event kind flows). Prints
one JSON object:

- ``off.per_request_us`` / ``publish.per_request_us``: the median over the rounds of the
  window's seconds over the requests its 8 clients completed in it (the request that straddles
  the window's end counts by the fraction inside), in microseconds (each round's in
  ``per_request_us_by_round``; ``mean_per_request_us``: all seconds over all requests);
  ``ratio`` = publish / off of those medians; ``ratio_by_round``: each round's publish / off,
  and ``ratio_paired_median`` their median;
- ``*.daemon_cpu_us_per_request``: the daemon process's CPU (user + system, every thread, from
  ``/proc/<pid>/stat``, read as the window starts and ends) over the requests of the window
  (the median over the rounds); ``cpu_ratio`` = publish / off of those medians,
  ``cpu_ratio_by_round`` and ``cpu_ratio_paired_median`` as above;
  ``publish.loop_us_per_request``: the loop's time in the publisher
  (``prefixd_kv_events_loop_seconds``) per request served, warm-up included; ``loop_share``:
  that over the daemon's CPU per request without publishing;
- ``events_per_s``, ``batches_per_s``: what the subscriber received inside the measured
  windows over their seconds; ``dropped_batches``: what the daemon counted dropped (0 expected);
- ``lag_p50_ms`` / ``lag_p99_ms``: from a commit's acknowledgment (``release`` returned in
  the client) to the subscriber's receipt of the ``BlockStored`` of that prompt's last full
  block (wall clock of one host; a batch that arrives before the reply counts 0, and
  ``received_before_ack`` is the fraction that did);
- ``host``: CPUs, the 1-minute load average at the start and the end.

``--aa``: the second daemon does not publish either (the noise of the design itself: its
ratios should sit at 1).

NOTE: the two daemons run at the same moment because, one after the other, two identical
daemons differed by ~11% on this 2-core shared host (load 7-14), four times the publisher's
cost; at the same moment they share the host's noise, and with a window of equal seconds
neither side runs alone at the end (a fixed count of requests would give the slower side the
host to itself for its tail, pulling the ratio toward 1). One round's ratio still swings by
+-15% (the scheduler's placement of ~20 runnable threads on 2 cores does not even out in a few
seconds), so the clients live across rounds: a round costs its window and the pause, not 16
processes connecting (25-45 s), and the medians rest on many rounds.

Usage: ``python bench/events.py --json [--rounds N] [--seconds S] [--aa] [--out PATH]``.
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
SIDES = ("off", "publish")
# NOTE: a pause after every round, so that the daemons' work behind it (write-behind to disk,
# a checkpoint) ends before the next round's clients start
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
    ``drain`` decodes what came (between rounds: the router's work stays off the measured
    seconds, which share two cores with it), keeping the receipt time of each ``BlockStored``
    on the GPU by its last block's token ids, and counting what came inside a window."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.raw: list = []
        self.events = self.batches = 0
        self.window_events = self.window_batches = 0
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

    def drain(self, window: tuple[float, float] = (0.0, 0.0)) -> None:
        """Decodes what came; batches received in ``window`` (wall clock) count in
        ``window_events`` / ``window_batches``."""
        raw, self.raw[:] = list(self.raw), []
        for now, seq_b, payload in raw:
            seq = int.from_bytes(seq_b, "big")
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = seq
            _, events, _ = msgpack.unpackb(payload)
            self.batches += 1
            self.events += len(events)
            if window[0] <= now <= window[1]:
                self.window_batches += 1
                self.window_events += len(events)
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


def worker(side: str, socket_path: str, seed: int, system: np.ndarray, warmup: int,
           seconds: float, barrier, stop, results) -> None:
    """A client: connects once, ``warmup`` requests, then window after window: the barrier
    (every client of both sides and the parent), requests for ``seconds``, and a report of the
    window's start, the requests completed in it (the last one by the fraction inside), the
    requests served since the last report, and per request in the window the last full
    block's tokens and the wall time its commit was acknowledged. Ends at the barrier after
    ``stop`` is set."""
    import prefixd.client as pc

    rng = np.random.default_rng(seed)

    def prompt() -> bytes:
        return np.concatenate([system, rng.integers(0, 50000, QUESTION, dtype="<i4")]).tobytes()

    full = (SYSTEM + QUESTION) // BS * BS * 4
    try:
        with pc.connect(socket_path, pc.KVLayout(**LAYOUT), name="bench-events") as s:
            served = 0
            for _ in range(warmup):
                s.release(s.open(prompt()), commit=True, durability="crash")
                served += 1
            while True:
                barrier.wait()
                if stop.is_set():
                    break
                acks, done = [], 0.0
                t0 = time.time()
                end = t0 + seconds
                while True:
                    p = prompt()
                    start = time.time()
                    s.release(s.open(p), commit=True, durability="crash")
                    now = time.time()
                    served += 1
                    if now > end:
                        done += max(0.0, end - start) / (now - start)
                        break
                    done += 1
                    acks.append((p[full - 4 * BS:full], now))
                results.put(("ok", side, t0, done, served, acks))
                served = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        results.put(("error", side, repr(exc)))


class Clients:
    """``CLIENTS`` client processes per daemon (``daemons``: by side), started and warmed up
    once, then measured round after round (``round``). Client ``i`` of every side draws its
    prompts from seed ``i``, so each side is asked the same."""

    def __init__(self, ctx, daemons: dict, system: np.ndarray, warmup: int,
                 seconds: float) -> None:
        self.daemons, self.seconds = daemons, seconds
        self.barrier = ctx.Barrier(len(daemons) * CLIENTS + 1)  # and this process: it times the CPU
        self.stop = ctx.Event()
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=worker, args=(side, d.socket, i, system, warmup, seconds,
                                                       self.barrier, self.stop, self.results),
                                  daemon=True)
                      for side, d in daemons.items() for i in range(CLIENTS)]
        for p in self.procs:
            p.start()

    def round(self) -> dict:
        """One window of every client at once, then the pause. Returns per side its requests
        in the window, its daemon's CPU seconds in the window (read here as the window starts
        and ends), its requests served since the last round (the warm-up in the first) and
        its publisher's loop seconds over them, and the window (wall clock)."""
        daemons, seconds = self.daemons, self.seconds
        loop0 = {side: _loop_s(d) for side, d in daemons.items()}
        cpu = {}
        try:
            self.barrier.wait()
            cpu0 = {side: cpu_s(d.pid()) for side, d in daemons.items()}
            time.sleep(seconds)
            cpu = {side: cpu_s(d.pid()) - cpu0[side] for side, d in daemons.items()}
        except threading.BrokenBarrierError:
            pass  # a client failed: its error comes through the queue
        got = [self.results.get(timeout=600) for _ in self.procs]
        errors = [g[2] for g in got if g[0] != "ok"]
        if errors:
            raise RuntimeError(f"a client failed: {errors}")
        time.sleep(SETTLE_S)  # the daemons' work behind the round ends before the next one
        out = {"window": (min(g[2] for g in got), max(g[2] for g in got) + seconds),
               "seconds": seconds}
        for side, d in daemons.items():
            mine = [g for g in got if g[1] == side]
            out[side] = {"requests": sum(g[3] for g in mine), "served": sum(g[4] for g in mine),
                         "daemon_cpu_s": cpu[side], "loop_s": _loop_s(d) - loop0[side],
                         "acks": [a for g in mine for a in g[5]]}
        return out

    def close(self) -> None:
        """The clients leave (at the barrier, if none failed) and are joined."""
        self.stop.set()
        try:
            self.barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def close_all(sub, daemons: dict, shm: str) -> None:
    """The end of a run: the subscriber (if any), every daemon stopped, the shm directory."""
    if sub is not None:
        sub.close()
    for d in daemons.values():
        d.stop(120.0)
        d.close()
    shutil.rmtree(shm, ignore_errors=True)


def main(argv=None) -> dict:
    global CLIENTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=24, help="rounds (both sides at once)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round")
    ap.add_argument("--warmup", type=int, default=10, help="requests per client before the window")
    ap.add_argument("--aa", action="store_true", help="the second daemon does not publish either")
    ap.add_argument("--clients", type=int, default=CLIENTS, help="clients per daemon")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    CLIENTS = args.clients  # Clients and the JSON read it
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    # this script too: each client then starts without importing numpy, zmq and msgpack again
    ctx.set_forkserver_preload(["__main__", "prefixd.client"])
    system = np.random.default_rng(0).integers(0, 50000, SYSTEM, dtype="<i4")
    shm = tempfile.mkdtemp(prefix="pd-bench-ev-", dir="/dev/shm")
    load0 = os.getloadavg()[0]
    daemons = {}
    sub = None
    try:
        for side in SIDES:
            base = tempfile.mkdtemp(prefix="pdev-", dir="/tmp")
            kv = KV if side == "publish" and not args.aa else ""
            d = DaemonProc(base, config=CONFIG.format(shm="{shm}", kv=kv).replace("{base}", base),
                           shm_dir=os.path.join(shm, side))
            os.makedirs(d.shm_dir, exist_ok=True)
            d.start(120.0)
            daemons[side] = d
        sub = Subscriber(f"ipc://{daemons['publish'].base}/kv")
        time.sleep(0.5)  # the subscription reaches the publisher
        rounds, lags = [], []
        clients = Clients(ctx, daemons, system, args.warmup, args.seconds)
        try:
            for _ in range(args.rounds):
                rd = clients.round()
                sub.drain(rd["window"])  # while the clients wait for the next round
                for key, t_ack in rd["publish"].pop("acks"):
                    t_recv = sub.seen.get(key)
                    if t_recv is not None:
                        lags.append(t_recv - t_ack)
                rd["off"].pop("acks")
                rounds.append(rd)
        finally:
            clients.close()
        out = summary(rounds, lags, sub, daemons["publish"], aa=args.aa)
        out["host"]["load_1m_start"] = round(load0, 2)
    finally:
        close_all(sub, daemons, shm)
    text = json.dumps(out, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text if args.json else f"publish/off {out['ratio']} cpu {out['cpu_ratio']} "
          f"lag p99 {out['lag_p99_ms']} ms")
    return out


def _median_ratio(a: list[float], b: list[float]) -> tuple[list[float], float]:
    by_round = [x / y for x, y in zip(a, b)]
    return [round(x, 3) for x in by_round], round(statistics.median(by_round), 3)


def summary(rounds: list[dict], lags: list[float], sub: Subscriber, pub_daemon,
            aa: bool = False) -> dict:
    """The JSON of a run (see the module's docstring) from ``Clients.round``'s results."""
    def side(name):
        rs = [rd[name] for rd in rounds]
        per = [rd["seconds"] / rd[name]["requests"] * 1e6 for rd in rounds]
        cpu = [r["daemon_cpu_s"] / r["requests"] * 1e6 for r in rs]
        seconds, requests = sum(rd["seconds"] for rd in rounds), sum(r["requests"] for r in rs)
        return {"per_request_us": round(statistics.median(per), 1),
                "mean_per_request_us": round(seconds / requests * 1e6, 1),
                "rps": round(requests / seconds, 1), "requests": round(requests),
                "daemon_cpu_us_per_request": round(statistics.median(cpu), 1),
                "per_request_us_by_round": [round(x, 1) for x in per],
                "daemon_cpu_us_per_request_by_round": [round(x, 1) for x in cpu]}

    off, pub = side("off"), side("publish")
    pub["loop_us_per_request"] = round(sum(rd["publish"]["loop_s"] for rd in rounds)
                                       / sum(rd["publish"]["served"] for rd in rounds) * 1e6, 1)
    by_round, paired = _median_ratio(pub["per_request_us_by_round"], off["per_request_us_by_round"])
    cpu_by_round, cpu_paired = _median_ratio(pub["daemon_cpu_us_per_request_by_round"],
                                             off["daemon_cpu_us_per_request_by_round"])
    window_s = sum(rd["window"][1] - rd["window"][0] for rd in rounds)
    early = sum(x < 0 for x in lags) / len(lags) if lags else None
    lags = sorted(max(0.0, x) for x in lags)
    stats = _stats(pub_daemon)
    return {
        "design": "simultaneous", "aa": aa,
        "off": off, "publish": pub,
        "ratio": round(pub["per_request_us"] / off["per_request_us"], 3),
        "ratio_paired_median": paired, "ratio_by_round": by_round,
        "cpu_ratio": round(pub["daemon_cpu_us_per_request"] / off["daemon_cpu_us_per_request"], 3),
        "cpu_ratio_paired_median": cpu_paired, "cpu_ratio_by_round": cpu_by_round,
        "rounds": len(rounds), "seconds_per_round": rounds[0]["seconds"] if rounds else None,
        "loop_share": round(pub["loop_us_per_request"] / off["daemon_cpu_us_per_request"], 4),
        "events_per_s": round(sub.window_events / window_s, 1) if window_s else None,
        "batches_per_s": round(sub.window_batches / window_s, 1) if window_s else None,
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
