"""The ``prefixctl`` command: look at a running prefixd and ask it for a checkpoint.

    prefixctl [--socket PATH] [--timeout S] status | stats [--json] | lookup ... | checkpoint
              | top [--interval S] | events [--from N] [--epoch E] [--json]
    prefixctl verify --state-dir DIR [--config FILE] [--json]   (offline, daemon stopped)

It speaks the raw ``prefixd.v1`` stubs over the daemon's Unix socket (no client library, no
torch: ``prefixctl status`` answers in a fraction of a second), and imports nothing of the
daemon's side (``tests/test_layering.py``); ``verify`` runs ``prefixd.tools.verify`` as a child
process, the one exception that test declares (see ``cmd_verify``).

Exit status:

- 0: done (``status``: the daemon serves);
- 1: the daemon refused or failed a call (one line: the status code and its message), or a
  bad argument that only the daemon's answer reveals (an unknown ``--model``);
- 2: bad command-line usage (`verify`: the directory cannot be checked, e.g. a daemon holds it);
- 3: no daemon answers on the socket (the line names the socket and what to check);
- 4: the daemon is up but not serving: recovering (with progress) or stopping.

NOTE: every command asks ``Status`` first. The daemon answers Status in every state, so an
UNAVAILABLE there means nobody is serving on the socket (exit 3), while an UNAVAILABLE from a
later call is the daemon's own refusal (exit 1). It costs one round trip of a millisecond.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys

import grpc

import prefixd
from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from prefixd.client import ctl_lookup, ctl_render, kv_events
from prefixd.client.errors import DeadlineExceeded, PrefixdError, Unavailable
from prefixd.config import paths

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NOT_SERVING = 0, 1, 2, 3, 4
DEFAULT_TIMEOUT_S = 10.0

SOCKET_HELP = ("the daemon's socket (default: $PREFIXD_SOCKET, else "
               "$XDG_RUNTIME_DIR/prefixd/prefixd.sock, else "
               "${XDG_STATE_HOME:-~/.local/state}/prefixd/prefixd.sock)")


def default_socket() -> str:
    """Where ``prefixd serve`` listens by default (its ``--socket`` unset), or
    ``$PREFIXD_SOCKET``: ``prefixd.config.paths.client_socket``, the daemon's own lookup."""
    return paths.client_socket()


class CtlExit(Exception):
    """Ends the command with ``code`` after printing ``message`` to stderr."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass
class Connection:
    """One connection to the daemon: the stub, the socket and the call deadline."""

    socket: str
    stub: pb_grpc.PrefixCacheStub
    timeout: float | None

    def call(self, method: str, request, timeout: float | None = ...):
        """``stub.method(request)``; a failure becomes ``CtlExit(1)`` naming code and message."""
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout if timeout is ... else timeout)
        except grpc.RpcError as exc:
            raise CtlExit(EXIT_FAILED, rpc_failure(method, exc)) from None

    def status(self) -> pb.StatusReply:
        """The daemon's Status; ``CtlExit(3)`` when nobody answers on the socket."""
        try:
            return self.stub.Status(pb.StatusRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CtlExit(EXIT_UNREACHABLE, unreachable(self.socket, exc)) from None
            raise CtlExit(EXIT_FAILED, rpc_failure("Status", exc)) from None

    def serving_status(self) -> pb.StatusReply:
        """Status, or ``CtlExit(4)`` unless the daemon serves (other rpcs would be refused)."""
        reply = self.status()
        if reply.state != "serving":
            raise CtlExit(EXIT_NOT_SERVING, f"prefixctl: the daemon on {self.socket} is "
                                            f"{ctl_render.state_line(reply)}: try again once it serves")
        return reply


def rpc_failure(method: str, exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = (exc.details() if hasattr(exc, "details") else "") or "(no message)"
    return f"prefixctl: {method} failed: {name}: {details}"


def unreachable(path: str, exc: grpc.RpcError | None = None) -> str:
    """Why nobody answers on ``path``, and what to check."""
    where = f"prefixctl: cannot reach prefixd on {path}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (f"{where}: no such socket. Is the daemon running (`prefixd serve`, or "
                f"`systemctl status prefixd`)? Is this its socket? (pass --socket PATH or set "
                f"PREFIXD_SOCKET to the path the daemon logged at start)")
    except PermissionError:
        return f"{where}: no permission to look into its directory (join the socket's group)"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{where}: that path is not a socket (pass --socket with the daemon's socket)"
    if not os.access(path, os.R_OK | os.W_OK):
        return (f"{where}: no permission to open the socket (mode {stat.S_IMODE(st.st_mode):o}): "
                f"run as its owner or join its group")
    detail = ""
    if exc is not None:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (f"{where}: the socket exists but nothing answered in time (a stopped or hung "
                    f"process?); raise --timeout or check the daemon's log")
        detail = f" ({exc.details()})" if exc.details() else ""
    return (f"{where}: the socket exists but nothing answers{detail}. The daemon may have died "
            f"and left it: check `systemctl status prefixd` or its log, then start it again")


# -- commands -------------------------------------------------------------------------------------


def cmd_status(daemon: Connection, args) -> int:
    reply = daemon.status()
    print(ctl_render.status_text(reply, daemon.socket))
    return EXIT_OK if reply.state == "serving" else EXIT_NOT_SERVING


def cmd_stats(daemon: Connection, args) -> int:
    daemon.serving_status()
    reply = daemon.call("Stats", pb.StatsRequest())
    print(ctl_render.stats_json(reply) if args.json else ctl_render.stats_table(reply))
    return EXIT_OK


def cmd_checkpoint(daemon: Connection, args) -> int:
    daemon.serving_status()
    # A checkpoint of large logs takes a while: no deadline unless --timeout was given.
    reply = daemon.call("Checkpoint", pb.CheckpointRequest(), timeout=args.timeout)
    print(f"checkpointed {reply.pools} pool{'' if reply.pools == 1 else 's'}")
    return EXIT_OK


def prepare_lookup(args) -> None:
    """The prompt's token ids, before any call (a usage error needs no daemon)."""
    try:
        args.token_ids = ctl_lookup.tokens_from_args(args.tokens, args.text, args.tokenizer,
                                                     special_tokens=not args.no_special_tokens)
    except ValueError as exc:
        raise CtlExit(EXIT_USAGE, f"prefixctl lookup: {exc}") from None


def cmd_lookup(daemon: Connection, args) -> int:
    tokens = args.token_ids
    layout = pick_layout(daemon.serving_status(), args.model)
    attach = daemon.call("Attach", pb.AttachRequest(client_name="prefixctl", layout=layout))
    try:
        reply = daemon.call("Lookup", pb.LookupRequest(session_id=attach.session_id,
                                                       tokens=ctl_lookup.pack(tokens)))
    finally:
        try:
            daemon.stub.Detach(pb.DetachRequest(session_id=attach.session_id), timeout=daemon.timeout)
        except grpc.RpcError:
            pass  # the session's lease ends it anyway
    print(ctl_render.lookup_text(reply, len(tokens), layout.model_id))
    return EXIT_OK


def pick_layout(status: pb.StatusReply, model: str | None) -> pb.KVLayout:
    try:
        return ctl_lookup.pick_layout(status.pools, model)
    except LookupError as exc:
        raise CtlExit(EXIT_FAILED, f"prefixctl lookup: {exc}") from None


def cmd_events(daemon: Connection, args) -> int:
    """The tenant's KV events, one per line, until the stream ends, Ctrl-C, or ``--timeout``
    seconds (then exit 0: a watch of that long). The stream's end is exit 1 (too slow:
    RESOURCE_EXHAUSTED) or 4 (the daemon stopped), with a line naming ``--from N --epoch E``
    to resume."""
    daemon.serving_status()
    last = None
    try:
        for event in kv_events.subscribe(daemon.stub, 0, args.from_number, args.epoch,
                                      timeout=args.timeout):
            print(json.dumps(event.to_json(), sort_keys=True) if args.json else str(event),
                  flush=True)
            last = event
    except DeadlineExceeded:
        return EXIT_OK
    except PrefixdError as exc:
        resume = (f" (resume: prefixctl events --from {last.sequence_number} --epoch {last.epoch})"
                  if last is not None else "")
        code = EXIT_NOT_SERVING if isinstance(exc, Unavailable) else EXIT_FAILED
        raise CtlExit(code, f"prefixctl: SubscribeEvents ended: {exc}{resume}") from None
    return EXIT_OK


def cmd_top(daemon: Connection, args) -> int:
    daemon.status()  # exit 3 with the reason before the screen is taken
    if not sys.stdout.isatty():
        raise CtlExit(EXIT_USAGE, "prefixctl top needs a terminal; use `prefixctl stats` in scripts")
    from prefixd.client import ctl_top  # curses only here

    return ctl_top.run(daemon, args.interval)


def cmd_verify(daemon: None, args) -> int:
    """Runs ``prefixd.tools.verify`` as a child process, and turns a death by signal into a
    finding.

    NOTE: a child process, not an import, for two reasons: the check opens the engine's files
    with the engine's own recovery (wal, storage, torch), which the client never loads; and a
    damaged LMDB file can kill its reader with SIGSEGV/SIGBUS, which a child turns into a
    report instead of a dead prefixctl. tests/test_layering.py declares this one child process
    as the client's only way to reach another part, and refuses any other."""
    import signal
    import subprocess

    cmd = [sys.executable, "-m", "prefixd.tools.verify", "--state-dir", args.state_dir]
    for flag in ("config", "scratch"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    if args.json:
        cmd.append("--json")
    rc = subprocess.call(cmd)
    if rc < 0:
        raise CtlExit(EXIT_FAILED, f"prefixctl verify: reading {args.state_dir} killed the checker "
                                   f"with {signal.Signals(-rc).name}: a damaged file (most likely "
                                   f"wal/data.mdb); restore it from a backup or start empty")
    return rc


# -- the command line -----------------------------------------------------------------------------


def _non_negative(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixctl", description="inspect a running prefixd daemon")
    parser.add_argument("--version", action="version", version=f"prefixctl {prefixd.__version__}")
    parser.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
    parser.add_argument("--timeout", metavar="S", type=float, default=None,
                        help=f"deadline of each call in seconds (default {DEFAULT_TIMEOUT_S:g}; "
                             f"checkpoint: none)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("status", help="up, recovering (with progress) or stopping; pools, sessions")
    p.set_defaults(run=cmd_status)
    p = sub.add_parser("stats", help="counters and gauges of this socket's tenant")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(run=cmd_stats)
    p = sub.add_parser("lookup", help="how many tokens of a prompt are cached, by tier (pins nothing)")
    p.add_argument("tokens", nargs="*", metavar="TOKEN_ID", help="token ids (or one comma-separated list)")
    p.add_argument("--text", help="the prompt as text (needs --tokenizer)")
    p.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer directory "
                                                      "(transformers; nothing is downloaded)")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="tokenize --text without the tokenizer's special tokens (BOS ...)")
    p.add_argument("--model", metavar="MODEL_ID",
                   help="the pool's model id (needed when the daemon has several pools)")
    p.set_defaults(run=cmd_lookup, prepare=prepare_lookup)
    p = sub.add_parser("events", help="KV events of this socket's tenant (blocks stored / "
                                      "removed per tier), replayed then live, one per line")
    p.add_argument("--from", dest="from_number", metavar="N", type=_non_negative, default=0,
                   help="only events after number N (default 0: all the daemon still holds)")
    p.add_argument("--epoch", metavar="E", type=_non_negative, default=0,
                   help="the epoch of N (from an earlier event; a different one starts with "
                        "'cleared')")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.set_defaults(run=cmd_events)
    p = sub.add_parser("checkpoint", help="fold every pool's log into a checkpoint now")
    p.set_defaults(run=cmd_checkpoint)
    p = sub.add_parser("top", help="a live view: hit rate, tiers, evictions, WAL latency (q quits)")
    p.add_argument("--interval", metavar="S", type=float, default=1.0,
                   help="seconds between refreshes (default 1)")
    p.set_defaults(run=cmd_top)
    p = sub.add_parser("verify", help="check a stopped daemon's state directory (offline): log, "
                                      "checkpoint, disk blocks, index; exit 1 on damage")
    p.add_argument("--state-dir", required=True, metavar="DIR")
    p.add_argument("--config", metavar="FILE", help="the daemon's config (pool sizes, salts)")
    p.add_argument("--scratch", metavar="DIR", help="where working copies go (default $TMPDIR)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(run=cmd_verify, offline=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    path = os.path.abspath(os.path.expanduser(args.socket or default_socket()))
    timeout = args.timeout if args.timeout is not None else DEFAULT_TIMEOUT_S
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        if getattr(args, "prepare", None):
            args.prepare(args)
        if getattr(args, "offline", False):
            return args.run(None, args)
        if not os.path.exists(path):
            raise CtlExit(EXIT_UNREACHABLE, unreachable(path))
        with grpc.insecure_channel("unix:" + path) as channel:
            return args.run(Connection(path, pb_grpc.PrefixCacheStub(channel), timeout), args)
    except CtlExit as exc:
        print(exc.message, file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
