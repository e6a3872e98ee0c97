"""The clients of the daemon fuzz (``test_fuzz.py``) that break off below the rpcs: bytes that
are not HTTP/2 written straight onto the socket (``raw_bytes``), a call in flight on a channel
closed or cancelled under it (``vanish_mid_call``), and a client process SIGKILLed while it
holds a KeepAlive stream and sequences (``kill_a_client``). Each must leave the daemon up and
its state as the fuzzer's model says: a vanished session ends, and nothing it held stays pinned.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from tests.daemon.fuzz_draw import BASE, LAYOUT
from tests.daemon.fuzz_ops import Fuzzer
from tests.daemon.harness import ROOT

KILLED_CLIENT = textwrap.dedent("""
    import sys, threading, time
    import grpc, numpy as np
    from prefixd.api import prefixd_pb2 as pb, prefixd_pb2_grpc as pb_grpc
    BASE = [np.arange(10_000 * (i + 1), 10_000 * (i + 1) + 96, dtype="<i4") for i in range(6)]
    LAYOUT = pb.KVLayout(model_id="fuzz", num_layers=2, num_kv_heads=2, head_dim=8,
                         dtype="float32", block_size=4)
    ch = grpc.insecure_channel("unix:" + sys.argv[1])
    stub = pb_grpc.PrefixCacheStub(ch)
    sid = stub.Attach(pb.AttachRequest(client_name="doomed", layout=LAYOUT)).session_id
    def pings():
        while True:
            yield pb.KeepAliveRequest(session_id=sid)
            time.sleep(0.05)
    stream = stub.KeepAlive(pings())
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()
    held = [stub.Open(pb.OpenRequest(session_id=sid, tokens=BASE[i].tobytes())).sequence.seq_id
            for i in range(4)]
    print("ready", flush=True)
    i = 0
    while True:  # killed somewhere in here, mid-call
        s = stub.Open(pb.OpenRequest(session_id=sid, tokens=BASE[i % 6][:40 + i % 50].tobytes()))
        stub.Extend(pb.ExtendRequest(session_id=sid, seq_id=s.sequence.seq_id,
                                     tokens=np.arange(7, dtype="<i4").tobytes()))
        stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=s.sequence.seq_id))
        i += 1
""")


def kill_a_client(d, rng: random.Random) -> None:
    """A client process with a KeepAlive stream and sequences, SIGKILLed mid-call; its session
    must end (Status stops counting it)."""
    before = d.stub().Status(pb.StatusRequest()).sessions
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, d.socket], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith(b"ready"), line + proc.stdout.read()
        time.sleep(rng.uniform(0, 0.05))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + 10
    while d.stub().Status(pb.StatusRequest()).sessions > before:
        assert time.monotonic() < deadline, "a killed client's session did not end"
        time.sleep(0.02)


def vanish_mid_call(d, fuzzer: Fuzzer, which: int, delay_us: int) -> None:
    """A call in flight on a channel that is closed under it (or cancelled), on a throwaway
    session detached after; commits only of prompts already indexed, so the model holds."""
    attached = fuzzer.call("Attach", fuzzer.stub.Attach,
                           pb.AttachRequest(client_name="vanish", layout=LAYOUT))
    if not isinstance(attached, pb.AttachReply):
        return
    sid = attached.session_id
    opened = fuzzer.call("Open", fuzzer.stub.Open,
                         pb.OpenRequest(session_id=sid, tokens=BASE[0].tobytes()))
    if not isinstance(opened, pb.OpenReply):  # the device pool is full of held blocks
        fuzzer.call("Detach", fuzzer.stub.Detach, pb.DetachRequest(session_id=sid))
        return
    seq = opened.sequence
    ch = grpc.insecure_channel("unix:" + d.socket)
    stub = pb_grpc.PrefixCacheStub(ch)
    calls = [
        lambda: stub.Open.future(pb.OpenRequest(session_id=sid, tokens=BASE[1][:77].tobytes())),
        lambda: stub.Commit.future(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id,
                                                    durability="power")),
        lambda: stub.Fork.future(pb.ForkRequest(session_id=sid, seq_id=seq.seq_id, num_children=3)),
        lambda: stub.KeepAlive(iter([pb.KeepAliveRequest(session_id=sid)] * 3)),
        lambda: stub.ReadKV(pb.ReadKVRequest(session_id=sid, seq_id=seq.seq_id, num_tokens=96)),
        lambda: stub.Extend.future(pb.ExtendRequest(session_id=sid, seq_id=seq.seq_id,
                                                    tokens=np.arange(9, dtype="<i4").tobytes())),
    ]
    call = calls[which % len(calls)]()
    fuzzer.calls["vanish"] += 1
    time.sleep(delay_us / 1e6)
    if which % 2:
        call.cancel()
    ch.close()
    try:  # the KeepAlive stream may have ended it already: NOT_FOUND then
        fuzzer.call("Detach", fuzzer.stub.Detach, pb.DetachRequest(session_id=sid))
    finally:
        fuzzer.stale.append(sid)


def raw_bytes(d, data: bytes, preface: bool, linger: bool) -> None:
    """Bytes that are not HTTP/2 (or a preface and then garbage) straight onto the socket."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect(d.socket)
        if preface:
            data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + data
        try:
            s.sendall(data)
            if linger:
                s.recv(4096)  # whatever the server answers (a GOAWAY, or nothing)
        except OSError:
            pass  # the server may hang up first: fine
    finally:
        s.close()
