"""Where a daemon's CPU goes, by thread, under ``bench/events.py``'s workload: a publishing
daemon and one that does not, at once (``events_load.Clients``), then each thread's CPU seconds
(``/proc/<pid>/task``) per request, by thread name.

Usage: ``python bench/lab/events_threads.py [--rounds N] [--seconds S] [--aa]``; ``--aa``: the
second daemon does not publish either (how far two equal daemons differ on this host).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "events_parts"))

import numpy as np  # noqa: E402

from events_load import SIDES, SYSTEM, Clients, close_all, cpu_s, start_daemon  # noqa: E402
from events_subscriber import Subscriber  # noqa: E402


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed; the loop's thread as
    ``loop``), the whole process's (``process``, exited threads included), and the loop
    thread's context switches (``loop_preempted``: involuntary, ``loop_blocked``: voluntary;
    printed per request like the seconds, in millionths)."""
    out: dict[str, float] = collections.defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except FileNotFoundError:
            continue
        fields = rest.split()
        name = "loop" if tid == str(pid) else head.split("(", 1)[1]
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    out["process"] = cpu_s(pid)
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                key, value = line.split(":")
                out["loop_blocked" if key[0] == "v" else "loop_preempted"] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per round")
    ap.add_argument("--aa", action="store_true", help="neither daemon publishes")
    args = ap.parse_args()
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["prefixd.client"])
    system = np.random.default_rng(0).integers(0, 50000, SYSTEM, dtype="<i4")
    shm = tempfile.mkdtemp(prefix="pd-lab-th-", dir="/dev/shm")
    daemons, sub = {}, None
    try:
        for side in SIDES:
            daemons[side] = start_daemon(shm, side, publish=side == "publish" and not args.aa)
        sub = Subscriber(f"ipc://{daemons['publish'].base}/kv")  # idle under --aa
        time.sleep(0.5)
        spent = {side: collections.defaultdict(float) for side in daemons}
        served = {side: 0 for side in daemons}
        clients = Clients(ctx, daemons, system, 10, args.seconds)
        try:
            for _ in range(args.rounds):
                before = {side: threads_cpu(d.pid()) for side, d in daemons.items()}
                r = clients.round()
                for side, d in daemons.items():
                    for name, s in threads_cpu(d.pid()).items():
                        spent[side][name] += s - before[side].get(name, 0.0)
                    served[side] += r[side]["served"]
                sub.drain()
        finally:
            clients.close()
        for side, by in spent.items():
            rows = sorted(by.items(), key=lambda kv: -kv[1])
            print(side, " ".join(f"{n}={s / served[side] * 1e6:.0f}us" for n, s in rows if s > 0))
    finally:
        close_all(sub, daemons, shm)


if __name__ == "__main__":
    main()
