"""Client processes for the daemon's kill -9 suite, over the raw generated stubs (the lease
suite's holders are ``tests.daemon.lease_holders``; both share the helpers here).

    python -m tests.daemon.gsp_load load SOCKET OUT_DIR COUNT SEED THINK_S LIB
    python -m tests.daemon.gsp_load serve-planted serve --config ... (prefixd serve, planted bug)
    python -m tests.daemon.gsp_load zygote      (forks a `prefixd serve` per stdin line)

``load`` (tests/crash/test_daemon_kill9.py): forks COUNT clients (indexes 0 .. COUNT - 1; the
last LIB of them are ``tests.daemon.lib_load.LibClient``, through the client library),
prints their pids and waits for stdin to close. Each sends gsp-like requests forever: opens a prompt (a
shared system prefix and a unique suffix), writes the KV of its uncached tokens through
``WriteKV`` and commits at ``crash`` durability (``Commit``, then the sequence is held until
the next request; or ``Release`` with ``commit``). Once the reply is received it appends one
JSON line to ``OUT_DIR/acks-INDEX``: the tokens, the committed full-block length and the digest
of their KV bytes. When the daemon goes away (UNAVAILABLE, or NOT_FOUND for its session after a
restart) it attaches again with backoff, ``Reclaim``s every previous session and checks what
came back against what it held: every sequence whose commit was acknowledged and that was not
released returns with at least its committed tokens, and every returned sequence's tokens and
KV bytes (``ReadKV``) are consistent. One JSON line per Reclaim goes to ``OUT_DIR/events-INDEX``.
Between requests it waits up to ``THINK_S`` (uniformly), as an engine between prompts: two
cores run the daemon, eight clients and the checker, and the checker must keep up.

KV is a function of each token's whole prefix (``kv_of``), as a model's would be: two clients
that share a prefix write identical bytes for it, so a committed block has one right value.
"""

from __future__ import annotations

import hashlib
import json
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

BS = 16
L, H, D = 2, 2, 4
LAYOUT = dict(model_id="gsp-load", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
              block_size=BS)
SYSTEM_LENGTHS = (40, 48, 64, 80)  # shared prefixes (not all block-aligned)
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def pb_layout() -> pb.KVLayout:
    return pb.KVLayout(**LAYOUT)


def systems() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(50000) for _ in range(n)] for n in SYSTEM_LENGTHS]


def packed(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def kv_of(tokens, start: int, n: int) -> np.ndarray:
    """KV ``[L, 2, n, H, D]`` of tokens ``start .. start + n``: each token's values come from a
    rolling hash of its whole prefix (exact in float32: all values are integers below 2**23)."""
    h, out = 0, []
    for t in tokens[:start + n]:
        h = (h * 1000003 + int(t) + 1) % 65521
        out.append(h)
    hs = np.asarray(out[start:], dtype=np.float32).reshape(1, 1, n, 1, 1)
    layer = np.arange(L, dtype=np.float32).reshape(L, 1, 1, 1, 1)
    kv = np.arange(2, dtype=np.float32).reshape(1, 2, 1, 1, 1)
    lane = np.arange(H * D, dtype=np.float32).reshape(1, 1, 1, H, D)
    return (hs * 64 + layer * 32 + kv * 16 + lane).astype(np.float32)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def write_kv(stub, session: int, seq_id: int, tokens, start: int) -> None:
    n = len(tokens) - start
    if n <= 0:
        return
    chunk = pb.KVChunk(seq_id=seq_id, start=start, num_tokens=n, shape=[L, 2, n, H, D],
                       dtype="float32", data=kv_of(tokens, start, n).tobytes())
    stub.WriteKV(iter([pb.WriteKVRequest(session_id=session, chunk=chunk)]), timeout=30)


def read_kv(stub, session: int, seq_id: int, n: int) -> bytes:
    req = pb.ReadKVRequest(session_id=session, seq_id=seq_id, start=0, num_tokens=n)
    return b"".join(r.chunk.data for r in stub.ReadKV(req, timeout=30))


class Log:
    """One JSON object per line, one ``write(2)`` on an O_APPEND descriptor (a kill leaves
    whole lines and at most one torn last line, which ``read_lines`` drops)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(self, obj: dict) -> None:
        os.write(self._fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())


def read_lines(path: str) -> list[dict]:
    try:
        with open(path, "rb") as f:
            data = f.read().decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data.split("\n")[:-1]]


class LineTail:
    """``read_lines`` of one append-only file, read incrementally: each ``read`` decodes only the
    whole lines appended since the last one (a partial last line waits for its newline).

    NOTE: the kill -9 soak polls every client's acks every 20 ms; re-reading whole files made
    it quadratic (about 105k lines re-parsed per poll by kill 70 of 100, a kill per 2-3 min).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.lines: list[dict] = []

    def read(self) -> list[dict]:
        """Every whole line so far, decoded (a new list: callers keep snapshots)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return list(self.lines)
        end = data.rfind(b"\n")
        if end >= 0:
            self.lines.extend(json.loads(line) for line in data[:end].split(b"\n"))
            self.offset += end + 1
        return list(self.lines)


# -- load -----------------------------------------------------------------------------------------

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
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        print(pid, flush=True)
    sys.stdin.read()


# -- the daemon with a planted bug ----------------------------------------------------------------

def serve_planted(argv: list[str]) -> int:
    """``prefixd serve`` whose Commit acknowledges BEFORE its ticket resolves (the planted bug
    the kill -9 suite must catch: tests/crash/test_daemon_kill9.py)."""
    from prefixd.daemon import cli, service

    async def Commit(self, request, context):  # noqa: N802 - the rpc's name
        session = self._session(request.session_id)
        session.owns(request.seq_id)
        session.pool.commit(request.seq_id, request.durability or "crash")  # ticket not awaited
        return pb.CommitReply(sequence=service.seq_reply(session.pool.sequence(request.seq_id)))

    service.PrefixCacheService.Commit = service.rpc(Commit)
    return cli.main(argv)


def _serve_forked(cli, log_path: str, argv: list[str]) -> int:
    """``prefixd serve`` in a forked child, as a fresh interpreter would run it: stdin from
    /dev/null, stdout and stderr appended to ``log_path``, a traceback printed and status 1 on
    an exception, ``sys.exit``'s status kept; returns the status for ``os._exit``."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(null)
        os.close(fd)
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to say
                pass
    return code


def zygote() -> None:
    """Import the daemon once, then fork one ``prefixd serve`` per stdin line (a JSON list:
    the log path, then the command's arguments) and print its pid.

    NOTE: the kill -9 suite restarts the daemon ten times; a fresh interpreter importing torch
    took 4-11 s of a loaded 2-core host each time, a fork takes milliseconds. The forked child
    is the daemon (its recovery, its sockets, its engine): only the imports came before the
    fork, and no channel, server, loop or engine exists in this process. Each daemon is the
    child of a waiter forked for it, which writes the daemon's exit status (as Popen's
    ``returncode``) to ``exit-<pid>`` beside its log once it is reaped.
    """
    import gc

    import prefixd.daemon.server  # noqa: F401 - torch, grpc and the engine, once
    from prefixd.daemon import cli

    # the imports, frozen here once: each daemon's start-up collection (collector.py) then
    # walks only its own objects, not the 180k it inherits (0.15 s of each start)
    gc.collect()
    gc.freeze()

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        log_path, *argv = json.loads(line)
        if os.fork() == 0:  # a waiter, reaped by the kernel: it waits for the daemon
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                os._exit(_serve_forked(cli, log_path, argv))
            print(pid, flush=True)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            with open(os.path.join(os.path.dirname(log_path), f"exit-{pid}.tmp"), "w") as f:
                f.write(str(status))
            os.rename(f.name, f.name[:-4])  # appears whole
            os._exit(0)


def main(argv: list[str]) -> int:
    if argv[0] == "load":
        socket, out_dir, count, seed, think_s, lib = argv[1:]
        fork_clients(socket, out_dir, int(count), int(seed), float(think_s), int(lib))
    elif argv[0] == "zygote":
        zygote()
    elif argv[0] == "serve-planted":
        return serve_planted(argv[1:])
    else:
        raise SystemExit(f"usage: see {__name__}'s docstring")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
