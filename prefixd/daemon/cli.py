"""The ``prefixd`` command: ``prefixd serve [--config FILE] [--state-dir DIR] [--socket PATH]``.

Exit status: 0 after a clean stop (SIGTERM/SIGINT), 1 when the daemon cannot start (the state
directory is locked by another daemon, a bad config, a socket in use, a recovery refused) with
one log line saying why, 2 for bad command-line usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import prefixd
from prefixd.config.paths import default_state_dir
from prefixd.daemon.logs import setup_logging

log = logging.getLogger("prefixd.daemon")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixd", description="prefix KV-cache daemon")
    parser.add_argument("--version", action="version", version=f"prefixd {prefixd.__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", metavar="FILE", help="TOML file: [engine] and [daemon] tables")
    serve.add_argument("--state-dir", metavar="DIR",
                       help="WAL, disk pool and lock (default: $XDG_STATE_HOME/prefixd)")
    serve.add_argument("--socket", metavar="PATH",
                       help="the first tenant's socket (default: $XDG_RUNTIME_DIR/prefixd/prefixd.sock)")
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 0 if args.command is None and argv is not None and not argv else 2
    return serve_command(args)


def serve_command(args) -> int:
    setup_logging("info")
    from prefixd.config.errors import ConfigError
    from prefixd.daemon import event_loop
    from prefixd.daemon.core import limit_intra_op_threads
    from prefixd.daemon.heap import keep_message_buffers
    from prefixd.daemon.reload import ConfigSource
    from prefixd.daemon.server import Daemon  # after logging: importing torch takes a moment
    from prefixd.engine.errors import EngineError
    from prefixd.wal.errors import StateLockedError, WalError
    from prefixd.storage.errors import StorageError

    try:
        source = ConfigSource(args.config, args.socket)  # a reload reads it the same way
        engine_config, config = source.load()
        setup_logging(config.log_level)
        state_dir = os.path.abspath(args.state_dir or default_state_dir())
        daemon = Daemon(state_dir, engine_config, config, source, end_process=True)
        keep_message_buffers()  # a process-wide policy: KV messages are MiBs (heap.py)
        log.info("torch intra-op threads=%d", limit_intra_op_threads())  # core.py's NOTE
        return event_loop.run(daemon.run)  # uvloop's when installed (event_loop.py)
    except StateLockedError as exc:
        log.error("not starting: %s", exc)
        return 1
    except (ConfigError, EngineError, WalError, StorageError, OSError) as exc:
        log.error("not starting: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
