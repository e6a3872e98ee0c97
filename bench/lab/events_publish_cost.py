"""The publisher's cost per request on the loop, free of the daemon: synthetic cache events
shaped as ``bench/events.py``'s gsp workload makes them (per request a 4-block question run
under a 32-block shared system run: stored on the device, copied to host and disk, an older
run dropped from the device, and, two requests in three, an older run forgotten by host or
disk), noted and flushed through a real ``KVPublishers`` (PUB on ``ipc://``, a subscriber
connected) every 7 requests, as the bench's 20 ms batches hold.

Usage: ``python bench/lab/events_publish_cost.py [--requests N] [--rounds N]``; prints the
loop's microseconds per request (``observe`` + ``flush``), the best of the rounds, and the
payload's digest (an unchanged wire gives an unchanged digest).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from prefixd.cache.events import BlocksDropped, BlocksMoved, BlocksStored, SeqReleased  # noqa: E402
from prefixd.config.kv_events_settings import KVEventsConfig  # noqa: E402
from prefixd.daemon.kv_publisher import KVPublishers  # noqa: E402

BS, SYSTEM_BLOCKS, QUESTION_BLOCKS, PER_BATCH = 16, 32, 4, 7


class Layout:
    block_size = BS
    model_id = "lab"


class Tree:
    def __init__(self, root_hash: bytes) -> None:
        self.roots = {b"": type("R", (), {"hashes": [root_hash]})()}


class Engine:
    def __init__(self, tree) -> None:
        self._pool = type("P", (), {"cache": type("C", (), {"tree": tree})()})()

    def pool(self, tenant, layout):
        return self._pool


class Loop:
    def call_later(self, delay, fn):
        return self


def workload(n: int, seed: int = 0):
    """Per request, the event batches a gsp request logs (as the engine hands them over)."""
    rng = np.random.default_rng(seed)
    h = lambda: rng.bytes(16)  # noqa: E731
    root = h()
    system = [h() for _ in range(SYSTEM_BLOCKS)]
    runs, out = [], []
    for i in range(n):
        q = [h() for _ in range(QUESTION_BLOCKS)]
        tokens = rng.integers(0, 50000, QUESTION_BLOCKS * BS, dtype="<i4").tobytes()
        slots = list(range(QUESTION_BLOCKS))
        batch = [BlocksStored(system[-1], q, tokens, slots), SeqReleased(i)]
        moves = [BlocksMoved(1, q, slots, [0] * 4), BlocksMoved(2, q, slots, [0] * 4)]
        drops = []
        if len(runs) > 8:
            drops.append(BlocksDropped(0, runs[-8], slots, False))
        if len(runs) > 20 and i % 3:
            drops.append(BlocksDropped(1 + i % 2, runs[-20], slots, i % 2 == 0))
        runs.append(q)
        out.append((batch, moves + drops))
    return root, out


def run(reqs, root, endpoint: str) -> tuple[float, str]:
    pubs = KVPublishers(KVEventsConfig(endpoint=endpoint), ["default"])
    sub_ctx = zmq.Context()
    sub = sub_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    time.sleep(0.3)
    pubs._loop, pubs._engine = Loop(), Engine(Tree(root))
    digest = hashlib.sha256()
    clock = time.thread_time_ns
    t0 = clock()
    for i, batches in enumerate(reqs):
        for events in batches:
            pubs.observe("default", Layout, events)
        if i % PER_BATCH == PER_BATCH - 1:
            pubs.flush()
    pubs.flush()
    spent = clock() - t0
    while sub.poll(200):
        _, _, payload = sub.recv_multipart()
        digest.update(payload[10:])  # past the array header and the float64 timestamp
    sub.close(0)
    sub_ctx.term()
    pubs._timer = None
    pubs.close()
    return spent / len(reqs) / 1e3, digest.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    root, reqs = workload(args.requests)
    base = tempfile.mkdtemp(prefix="pdlab-", dir="/tmp")
    results = [run(reqs, root, f"ipc://{base}/kv{r}") for r in range(args.rounds)]
    per = [r[0] for r in results]
    print(f"loop us/request: best {min(per):.1f} rounds {[round(x, 1) for x in per]} "
          f"digest {set(r[1] for r in results)}")
    os.rmdir(base) if not os.listdir(base) else None


if __name__ == "__main__":
    main()
