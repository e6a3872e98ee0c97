"""Holders for the daemon's lease suite (tests/daemon/test_leases.py): processes that attach,
take sequences and wait to be SIGKILLed without Detach.

    python -m tests.daemon.lease_holders SOCKET OUT_DIR

imports once, then forks a holder per stdin line ``NAME MODE SEED`` and prints its pid. A
holder attaches, opens sequences (``MODE`` says how: private uncommitted blocks, forks, pinned
shared prefixes, and whether a KeepAlive stream holds the session), writes ``OUT_DIR/NAME.ready``
and waits to be killed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from tests.daemon.gsp_workload import BS, packed, pb_layout, systems, write_kv

HOLD_MODES = ("private", "forked", "pinned")


def hold(socket: str, out_dir: str, name: str, mode: str, seed: int) -> None:
    """Attach, take sequences as ``mode`` says, write ``NAME.ready``, wait to be killed.

    ``mode`` is ``KIND[+keepalive|+stalled]``: ``private`` opens two unique prompts and writes
    their KV (uncommitted private blocks); ``forked`` commits a unique prompt, forks it three
    ways and extends each child (copy-on-write of the shared partial block); ``pinned`` opens a
    shared system prefix (its indexed blocks pinned) and extends it. ``+keepalive`` holds the
    session with a KeepAlive stream pinging every lease / 4; ``+stalled`` opens the stream,
    pings once and never again; neither: no stream at all.
    """
    kind, _, ka = mode.partition("+")
    rng = random.Random(seed)
    stub = pb_grpc.PrefixCacheStub(grpc.insecure_channel("unix:" + socket))
    reply = stub.Attach(pb.AttachRequest(client_name=name, layout=pb_layout()), timeout=10)
    sid = reply.session_id
    if ka:
        _keepalive(stub, sid, reply.lease_s / 4 if ka == "keepalive" else None)
    indexed = 0

    def unique(n):
        return [rng.randrange(50000, 90000) for _ in range(n)]

    def open_(tokens):
        seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)), timeout=10).sequence
        write_kv(stub, sid, seq.seq_id, tokens, seq.cached_tokens)
        return seq

    if kind == "private":
        for _ in range(2):
            open_(unique(rng.randint(2 * BS, 5 * BS)))
    elif kind == "forked":
        tokens = unique(rng.randint(2 * BS, 4 * BS) + BS // 2)
        seq = open_(tokens)
        indexed += stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id, durability="crash"),
                               timeout=10).indexed_blocks
        kids = stub.Fork(pb.ForkRequest(session_id=sid, seq_id=seq.seq_id, num_children=3),
                         timeout=10).children
        for kid in kids:
            more = unique(rng.randint(1, BS))
            stub.Extend(pb.ExtendRequest(session_id=sid, seq_id=kid.seq_id, tokens=packed(more)),
                        timeout=10)
    elif kind == "pinned":
        tokens = rng.choice(systems())
        seq = open_(tokens)
        stub.Extend(pb.ExtendRequest(session_id=sid, seq_id=seq.seq_id, tokens=packed(unique(BS))),
                    timeout=10)
    else:
        raise SystemExit(f"unknown hold mode {mode!r}")
    with open(os.path.join(out_dir, name + ".ready.tmp"), "w") as f:
        json.dump({"session": sid, "indexed": indexed}, f)
    os.rename(os.path.join(out_dir, name + ".ready.tmp"), os.path.join(out_dir, name + ".ready"))
    while True:
        time.sleep(3600)


def _keepalive(stub, sid: int, period: float | None) -> None:
    """A KeepAlive stream on a thread: a ping every ``period`` s, or one ping and then silence
    (``period`` None: a stalled client whose stream stays open)."""
    stop = threading.Event()

    def pings():
        yield pb.KeepAliveRequest(session_id=sid)
        while not stop.wait(period if period else 3600):
            yield pb.KeepAliveRequest(session_id=sid)

    def run():
        try:
            for _ in stub.KeepAlive(pings()):
                pass
        except grpc.RpcError:
            pass

    threading.Thread(target=run, daemon=True).start()


def spawner(socket: str, out_dir: str) -> None:
    """Fork a holder per stdin line ``NAME MODE SEED``; print its pid (holders are reaped by
    the kernel: SIGCHLD is ignored). No channel exists here before a fork (gRPC and fork)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        name, mode, seed = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                hold(socket, out_dir, name, mode, int(seed))
            except BaseException as exc:  # noqa: BLE001 - reported through the ready file
                with open(os.path.join(out_dir, name + ".failed"), "w") as f:
                    f.write(repr(exc))
                code = 3
            os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    spawner(*sys.argv[1:])
