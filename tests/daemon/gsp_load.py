"""The load of the daemon's kill -9 suite (tests/crash/test_daemon_kill9.py) and of its KV-event
suite (tests/daemon/test_kv_events_dynamo.py): client processes over the raw generated stubs.

    python -m tests.daemon.gsp_load SOCKET OUT_DIR COUNT SEED THINK_S LIB

forks COUNT clients (indexes 0 .. COUNT - 1; the last LIB of them are
``tests.daemon.lib_load.LibClient``, through the client library), prints their pids and waits
for stdin to close. Each sends gsp-like requests (``tests.daemon.gsp_workload``) forever: opens
a prompt (a shared system prefix and a unique suffix), writes the KV of its uncached tokens
through ``WriteKV`` and commits at ``crash`` durability (``Commit``, then the sequence is held
until the next request; or ``Release`` with ``commit``). Once the reply is received it appends
one JSON line (``tests.daemon.json_lines``) to ``OUT_DIR/acks-INDEX``: the tokens, the committed
full-block length and the digest of their KV bytes. When the daemon goes away (UNAVAILABLE, or
NOT_FOUND for its session after a restart) it attaches again with backoff, ``Reclaim``s every
previous session and checks what came back against what it held: every sequence whose commit
was acknowledged and that was not released returns with at least its committed tokens, and
every returned sequence's tokens and KV bytes (``ReadKV``) are consistent. One JSON line per
Reclaim goes to ``OUT_DIR/events-INDEX``. Between requests it waits up to ``THINK_S``
(uniformly), as an engine between prompts: two cores run the daemon, eight clients and the
checker, and the checker must keep up.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback

import grpc
import numpy as np

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from tests.daemon.gsp_workload import BS, digest, kv_of, packed, pb_layout, read_kv, systems, write_kv
from tests.daemon.json_lines import Log

RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Reconnect(Exception):
    """The daemon went away (or restarted): attach again and reclaim."""


class LoadClient:
    """One gsp-like client that survives daemon restarts (see the module docstring).

    ``known``: every sequence of the current session the client learned of (id -> tokens), and
    ``held``: those whose commit was acknowledged and whose release was not sent (id -> ack).

    NOTE: a released sequence may come back from a Reclaim: a release is not made durable by
    itself (``Release`` with ``commit`` waits for the commit's records only), so a kill right
    after it may leave the sequence live in the log. Such a sequence is checked for consistent
    tokens and bytes like any other; only a sequence the session never had is an error.
    """

    def __init__(self, socket: str, out_dir: str, index: int, seed: int, think_s: float = 0.0) -> None:
        self.think_s = think_s
        self.channel = grpc.insecure_channel("unix:" + socket)
        self.stub = pb_grpc.PrefixCacheStub(self.channel)
        self.acks = Log(os.path.join(out_dir, f"acks-{index}"))
        self.events = Log(os.path.join(out_dir, f"events-{index}"))
        self.index = index
        self.rng = random.Random(seed)
        self.systems = systems()
        self.session = 0
        self.known: dict[int, list[int]] = {}
        self.held: dict[int, dict] = {}
        self.lenient = False  # an Open / Reclaim was cut: unknown sequences may come back
        self.pending: list[dict] = []  # previous sessions to Reclaim

    def run(self) -> None:
        self.reattach()
        while True:
            try:
                self.request()
                time.sleep(self.rng.random() * self.think_s)
            except Reconnect:
                self.reattach()

    def reattach(self) -> None:
        """``attach`` until one gets through its Reclaims (a kill may cut one: it is retried
        on the next daemon, the cut one's sequences marked as possibly moved)."""
        while True:
            try:
                return self.attach()
            except Reconnect:
                continue

    def call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code in RETRY or (code is grpc.StatusCode.NOT_FOUND and "no session" in details):
                raise Reconnect() from None
            self.events.add({"error": f"{code.name}: {details}"})
            raise

    def request(self) -> None:
        tokens = self.rng.choice(self.systems) + [self.rng.randrange(50000)
                                                  for _ in range(self.rng.randint(8, 56))]
        if len(tokens) % BS == 0:
            tokens.append(self.rng.randrange(50000))  # a partial last block stays private
        self.lenient = True  # until the reply names the sequence
        seq = self.call(self.stub.Open, pb.OpenRequest(session_id=self.session,
                                                       tokens=packed(tokens)), timeout=30).sequence
        self.known[seq.seq_id] = tokens
        self.lenient = False
        self.call(write_kv, self.stub, self.session, seq.seq_id, tokens, seq.cached_tokens)
        full = len(tokens) // BS * BS
        ack = {"session": self.session, "seq": seq.seq_id, "tokens": tokens, "full": full,
               "digest": digest(kv_of(tokens, 0, full).tobytes())}
        if self.rng.random() < 0.5:
            self.call(self.stub.Commit, pb.CommitRequest(session_id=self.session, seq_id=seq.seq_id,
                                                         durability="crash"), timeout=30)
            self.acks.add(dict(ack, via="commit"))
            for old in list(self.held):
                self.release(old)
            self.held[seq.seq_id] = ack
        else:
            self.call(self.stub.Release, pb.ReleaseRequest(session_id=self.session, seq_id=seq.seq_id,
                                                           commit=True, durability="crash"),
                      timeout=30)
            self.acks.add(dict(ack, via="release"))

    def release(self, seq_id: int) -> None:
        self.held.pop(seq_id, None)
        self.call(self.stub.Release, pb.ReleaseRequest(session_id=self.session, seq_id=seq_id),
                  timeout=30)

    def attach(self) -> None:
        if self.session:
            self.pending.append({"session": self.session, "known": dict(self.known),
                                 "held": dict(self.held), "lenient": self.lenient,
                                 "moved": False})
        self.session, self.known, self.held, self.lenient = 0, {}, {}, False
        backoff = 0.02
        while True:
            try:
                reply = self.stub.Attach(pb.AttachRequest(client_name=f"load-{self.index}",
                                                          layout=pb_layout()), timeout=5)
                break
            except grpc.RpcError:
                time.sleep(backoff)
                backoff = min(0.5, backoff * 2)
        self.session = reply.session_id
        for entry in list(self.pending):
            try:
                got = self.call(self.stub.Reclaim, pb.ReclaimRequest(
                    session_id=self.session, previous_session_id=entry["session"]), timeout=30)
            except Reconnect:
                entry["moved"] = self.lenient = True  # some may have moved to this session
                raise
            self.pending.remove(entry)
            self.check_reclaim(entry, got)

    def check_reclaim(self, entry: dict, got: pb.ReclaimReply) -> None:
        bad = []
        back = {s.previous_seq_id: s for s in got.sequences}
        for seq_id, ack in entry["held"].items():
            s = back.get(seq_id)
            if s is None or s.num_tokens < ack["full"]:
                if not entry["moved"]:  # unless a cut Reclaim moved them
                    bad.append(f"held sequence {seq_id} (acknowledged {ack['full']} tokens) came "
                               f"back with {None if s is None else s.num_tokens}")
        for s in got.sequences:
            tokens = [int(t) for t in np.frombuffer(s.tokens, dtype="<i4")]
            mine = entry["known"].get(s.previous_seq_id)
            if mine is None and not entry["lenient"]:
                bad.append(f"sequence {s.previous_seq_id} came back, never opened in that session")
            if s.num_tokens % BS or len(tokens) != s.num_tokens or (
                    mine is not None and tokens != mine[:s.num_tokens]):
                bad.append(f"sequence {s.previous_seq_id} came back with other tokens")
            if s.seq_id:
                self.known[s.seq_id] = tokens
                if s.previous_seq_id in entry["held"]:
                    self.held[s.seq_id] = entry["held"][s.previous_seq_id]
                data = self.call(read_kv, self.stub, self.session, s.seq_id, s.num_tokens)
                if digest(data) != digest(kv_of(tokens, 0, s.num_tokens).tobytes()):
                    bad.append(f"sequence {s.previous_seq_id} came back with other KV bytes")
        self.events.add({"reclaim": entry["session"], "session": self.session,
                         "held": len(entry["held"]), "returned": len(got.sequences),
                         "lenient": entry["lenient"], "moved": entry["moved"], "bad": bad})
        for seq_id in [s.seq_id for s in got.sequences if s.seq_id]:
            self.release(seq_id)


def fork_clients(socket: str, out_dir: str, count: int, seed: int, think_s: float,
                 lib: int = 0) -> None:
    """Fork ``count`` load clients, the last ``lib`` of them through the client library
    (``tests.daemon.lib_load``), print their pids, and wait for stdin to close. One
    interpreter's imports serve all (no channel exists here before the forks). Each client's
    stderr is ``OUT_DIR/stderr-INDEX``; the kernel reaps them (SIGCHLD ignored)."""
    client = LoadClient
    if lib:
        from tests.daemon.lib_load import LibClient  # torch, imported once before the forks
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for index in range(count):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                fd = os.open(os.path.join(out_dir, f"stderr-{index}"),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 2)
                if index >= count - lib:
                    client = LibClient
                client(socket, out_dir, index, seed * 100 + index, think_s).run()
            except BaseException:  # noqa: BLE001 - the test reads the traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        print(pid, flush=True)
    sys.stdin.read()


def main(argv: list[str]) -> int:
    if len(argv) != 6:
        raise SystemExit(f"usage: see {__name__}'s docstring")
    socket, out_dir, count, seed, think_s, lib = argv
    fork_clients(socket, out_dir, int(count), int(seed), float(think_s), int(lib))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
