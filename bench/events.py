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
daemons differ by ~11% on a 2-core shared host at a load of 7-14, four times the publisher's
cost; at the same moment they share the host's noise, and with a window of equal seconds
neither side runs alone at the end (a fixed count of requests would give the slower side the
host to itself for its tail, pulling the ratio toward 1). One round's ratio still swings by
+-15% (the scheduler's placement of ~20 runnable threads on 2 cores does not even out in a few
seconds), so the clients live across rounds: a round costs its window and the pause, not 16
processes connecting (25-45 s), and the medians rest on many rounds.

Its parts live in ``bench/events_parts/``: ``events_load.py`` (the daemons, their clients and
the CPU readings) and ``events_subscriber.py`` (the router's side); this file runs the rounds
and prints the JSON.

Usage: ``python bench/events.py --json [--rounds N] [--seconds S] [--aa] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH / "events_parts"))  # its parts: the load, the subscriber

import numpy as np  # noqa: E402

from events_load import (BS, CLIENTS, QUESTION, SIDES, SYSTEM, Clients, close_all,  # noqa: E402
                         daemon_stats, start_daemon)
from events_subscriber import Subscriber  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=24, help="rounds (both sides at once)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round")
    ap.add_argument("--warmup", type=int, default=10, help="requests per client before the window")
    ap.add_argument("--aa", action="store_true", help="the second daemon does not publish either")
    ap.add_argument("--clients", type=int, default=CLIENTS, help="clients per daemon")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
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
            daemons[side] = start_daemon(shm, side, publish=side == "publish" and not args.aa)
        sub = Subscriber(f"ipc://{daemons['publish'].base}/kv")
        time.sleep(0.5)  # the subscription reaches the publisher
        rounds, lags = [], []
        clients = Clients(ctx, daemons, system, args.warmup, args.seconds, num_clients=args.clients)
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
        out = summary(rounds, lags, sub, daemons["publish"], num_clients=args.clients, aa=args.aa)
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
            num_clients: int = CLIENTS, aa: bool = False) -> dict:
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
    stats = daemon_stats(pub_daemon)
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
        "clients": num_clients, "prompt_tokens": SYSTEM + QUESTION, "block_size": BS,
        "host": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
                 "python": platform.python_version()},
    }


if __name__ == "__main__":
    main()
