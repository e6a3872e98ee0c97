"""Where the KV-event publisher's time goes on the daemon's loop: ``bench/events.py``'s
workload against one publishing daemon run under cProfile, then the profile's rows for the
publisher's modules and the engine listener beside the daemon's total.

Usage: ``python bench/lab/events_profile.py [--phases N] [--seconds S] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pstats
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "events_parts"))
sys.path.insert(0, str(ROOT / "bench" / "rpc_parts"))

import numpy as np  # noqa: E402

from events_load import SYSTEM, Clients, daemon_config  # noqa: E402
from events_subscriber import Subscriber  # noqa: E402
from prefixd.tools.daemon_proc import DaemonProc  # noqa: E402
from rpc_daemon import _PROFILED  # noqa: E402

MODULES = ("kv_publisher", "kv_wire", "kv_lineage", "event_journal", "server.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per phase")
    ap.add_argument("--off", action="store_true", help="profile a daemon that does not publish")
    ap.add_argument("--out", default="/tmp/events.prof")
    args = ap.parse_args()
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["prefixd.client"])
    system = np.random.default_rng(0).integers(0, 50000, SYSTEM, dtype="<i4")
    shm = tempfile.mkdtemp(prefix="pd-lab-ev-", dir="/dev/shm")
    base = tempfile.mkdtemp(prefix="pdev-", dir="/tmp")
    d = DaemonProc(base, config=daemon_config(base, publish=not args.off), shm_dir=shm,
                   entry=["-c", _PROFILED.format(profile=args.out), "-m", "prefixd.daemon.cli"])
    sub = None
    try:
        d.start(120.0)
        if not args.off:
            sub = Subscriber(f"ipc://{base}/kv")
            time.sleep(0.5)
        clients = Clients(ctx, {"publish": d}, system, 10, args.seconds)
        try:
            for _ in range(args.phases):
                r = clients.round()
                print(f"phase: {r['seconds'] / r['publish']['requests'] * 1e6:.0f} us/request")
                if sub is not None:
                    sub.drain()
        finally:
            clients.close()
    finally:
        if sub is not None:
            sub.close()
        d.stop(120.0)
        d.close()
        shutil.rmtree(shm, ignore_errors=True)
    st = pstats.Stats(args.out)
    total = max(v[3] for v in st.stats.values())
    print(f"profile total (largest cumulative) {total:.2f} s")
    rows = [(k, v) for k, v in st.stats.items() if any(m in k[0] for m in MODULES)]
    rows.sort(key=lambda kv: -kv[1][3])
    for (path, line, name), (cc, nc, tt, ct, _) in rows[:40]:
        print(f"{ct:8.3f} cum {tt:8.3f} own {nc:9d} calls  {os.path.basename(path)}:{line} {name}")


if __name__ == "__main__":
    main()
