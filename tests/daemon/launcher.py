"""``prefixd serve`` for tests that need a fault inside the daemon: installs it, then runs the
daemon's own ``main`` (nothing of it lives in the product).

    python -m tests.daemon.launcher [--watchdog-stall PATH] [--background-error]
                                    [--exit-status N] [--ack-before-ticket] serve --config ...

- ``--watchdog-stall PATH``: the watchdog's ``probe`` blocks the event loop while ``PATH``
  exists, as a hung engine call would, with ``PATH.stalled`` present while it blocks
  (tests/daemon/test_sd_notify.py).
- ``--background-error``: once serving, a callback on the loop raises, as a bug in a
  background task would; asyncio logs it at ERROR (the harness's own check must catch it).
- ``--exit-status N``: the daemon stops cleanly but its stop returns ``N`` (the exit status).
- ``--ack-before-ticket``: Commit replies before its ticket resolves, the planted bug the
  kill -9 suite must catch (tests/crash/test_daemon_kill9.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


def install_watchdog_stall(path: str) -> None:
    from prefixd.daemon import lifecycle

    real = lifecycle.probe

    def probe(core):
        if os.path.exists(path):
            with open(path + ".stalled", "w"):
                pass  # the test waits for this: from here no ping can go out
            while os.path.exists(path):
                time.sleep(0.05)
            os.unlink(path + ".stalled")
        return real(core)

    lifecycle.probe = probe  # the watchdog calls the module's global (lifecycle.py's NOTE)


def install_background_error() -> None:
    from prefixd.daemon import server

    run = server.Daemon.run

    async def run_with_a_failing_callback(daemon):
        def fail():
            raise RuntimeError("planted background failure")

        asyncio.get_running_loop().call_later(0.5, fail)
        return await run(daemon)

    server.Daemon.run = run_with_a_failing_callback


def install_exit_status(status: int) -> None:
    from prefixd.daemon import server

    shutdown = server.Daemon._shutdown

    async def shutdown_with_status(daemon, ticker):
        await shutdown(daemon, ticker)
        return status

    server.Daemon._shutdown = shutdown_with_status


def install_ack_before_ticket() -> None:
    from prefixd.api import prefixd_pb2 as pb
    from prefixd.daemon import service

    async def Commit(self, request, context):  # noqa: N802 - the rpc's name
        session = self._session(request.session_id)
        session.owns(request.seq_id)
        session.pool.commit(request.seq_id, request.durability or "crash")  # ticket not awaited
        return pb.CommitReply(sequence=service.seq_reply(session.pool.sequence(request.seq_id)))

    service.PrefixCacheService.Commit = service.rpc(Commit)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tests.daemon.launcher")
    parser.add_argument("--watchdog-stall", metavar="PATH")
    parser.add_argument("--background-error", action="store_true")
    parser.add_argument("--exit-status", type=int)
    parser.add_argument("--ack-before-ticket", action="store_true")
    ours, rest = parser.parse_known_args(argv)
    if ours.watchdog_stall:
        install_watchdog_stall(ours.watchdog_stall)
    if ours.background_error:
        install_background_error()
    if ours.exit_status is not None:
        install_exit_status(ours.exit_status)
    if ours.ack_before_ticket:
        install_ack_before_ticket()
    from prefixd.daemon import cli

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
