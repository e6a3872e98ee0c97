"""The load ``bench/events.py`` measures: its two daemons, their clients, and the daemons' CPU.

A daemon is a ``prefixd serve`` process on fresh state (``start_daemon``: a short ``/tmp``
directory for state and sockets, its pools in ``/dev/shm``), the same for both sides but for
``[daemon.kv_events]`` (``daemon_config``: on the publishing side, a PUB and a replay ROUTER
on ``ipc://`` in its directory). Layout ``bench-events``: 1 layer x 1 KV head x head dim 8,
fp16, block 16 (512-byte blocks), tiers device / host / disk small enough that blocks are
evicted and demoted (so every event kind flows).

``Clients`` holds ``CLIENTS`` client processes (``prefixd.client``) per daemon, forked from a
``multiprocessing`` forkserver, connected and warmed up once, then measured round after round:
all of them pass one barrier with this process, and each does gsp requests for the same
seconds (``worker``: ``open`` of a shared 512-token system prompt + a unique 64-token
question, then ``release`` with commit at durability ``crash``). This process reads each
daemon's CPU (``cpu_s``, from ``/proc``) as the window starts and ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import numpy as np

from prefixd.tools.daemon_proc import DaemonProc

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


def daemon_config(base: str, publish: bool) -> str:
    """``CONFIG`` for a daemon in ``base``, with ``KV`` (its publisher's endpoints in ``base``)
    when ``publish``; ``{shm}`` is left for ``DaemonProc`` to fill."""
    return CONFIG.format(shm="{shm}", kv=KV if publish else "").replace("{base}", base)


def start_daemon(shm: str, side: str, publish: bool) -> DaemonProc:
    """A started daemon of side ``side``: state in a fresh ``/tmp`` directory, pools in
    ``shm``/``side``, publishing when ``publish``."""
    base = tempfile.mkdtemp(prefix="pdev-", dir="/tmp")
    d = DaemonProc(base, config=daemon_config(base, publish), shm_dir=os.path.join(shm, side))
    os.makedirs(d.shm_dir, exist_ok=True)
    d.start(120.0)
    return d


def close_all(sub, daemons: dict, shm: str) -> None:
    """The end of a run: the subscriber (if any), every daemon stopped, the shm directory."""
    if sub is not None:
        sub.close()
    for d in daemons.values():
        d.stop(120.0)
        d.close()
    shutil.rmtree(shm, ignore_errors=True)


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system, every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_stats(d) -> dict:
    """The daemon's Stats values (one short client session)."""
    import prefixd.client as pc

    with pc.connect(d.socket, pc.KVLayout(**LAYOUT), name="bench-events-stats") as s:
        return s.stats()


def loop_s(d) -> float:
    """The daemon's loop seconds in its KV-event publisher so far (0 when it does not publish)."""
    return daemon_stats(d).get("prefixd_kv_events_loop_seconds_total", 0.0)


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
    """``num_clients`` client processes per daemon (``daemons``: by side), started and warmed
    up once, then measured round after round (``round``). Client ``i`` of every side draws its
    prompts from seed ``i``, so each side is asked the same."""

    def __init__(self, ctx, daemons: dict, system: np.ndarray, warmup: int,
                 seconds: float, num_clients: int = CLIENTS) -> None:
        self.daemons, self.seconds = daemons, seconds
        self.barrier = ctx.Barrier(len(daemons) * num_clients + 1)  # and this process: it times the CPU
        self.stop = ctx.Event()
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=worker, args=(side, d.socket, i, system, warmup, seconds,
                                                       self.barrier, self.stop, self.results),
                                  daemon=True)
                      for side, d in daemons.items() for i in range(num_clients)]
        for p in self.procs:
            p.start()

    def round(self) -> dict:
        """One window of every client at once, then the pause. Returns per side its requests
        in the window, its daemon's CPU seconds in the window (read here as the window starts
        and ends), its requests served since the last round (the warm-up in the first) and
        its publisher's loop seconds over them, and the window (wall clock)."""
        daemons, seconds = self.daemons, self.seconds
        loop0 = {side: loop_s(d) for side, d in daemons.items()}
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
                         "daemon_cpu_s": cpu[side], "loop_s": loop_s(d) - loop0[side],
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
