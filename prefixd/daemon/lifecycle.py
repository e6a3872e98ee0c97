"""What systemd is told, and when: recovery progress, ready, watchdog pings, reload, stop.

- While the engine recovers on its worker thread, a task on the loop sends ``STATUS=`` with
  the records replayed / to replay (``core.progress``) twice a second.
- ``READY=1`` goes out only once every tenant socket answered a health check made through
  it (a real gRPC call on the socket) and recovery is done: ``systemctl start`` returns when
  clients can be served, not when the process began.
- ``WATCHDOG=1`` comes from a loop on the event loop that first makes a real engine call
  (``probe``): a lookup on every pool, and a check that no pool's log has failed. A loop
  that stalls, an engine call that hangs, or a poisoned log stops the pings, and systemd
  restarts the daemon after ``WatchdogSec=`` (recovery then serves what was durable).
- ``RELOADING=1`` / ``READY=1`` around a config reload (``prefixd.daemon.reload``),
  ``STOPPING=1`` when a stop begins.

NOTE: the watchdog calls ``probe`` through this module's global, so a test's launcher
(``tests/daemon/launcher.py``) can wrap it to stall the serving loop as a hung engine call
would; SIGSTOP would not show a stalled loop: it stops every thread, a thread-based pinger
included.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixd.daemon.core import RECOVERING, SERVING, DaemonCore
from prefixd.daemon.notify import Notifier

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 0.5  # recovery progress on STATUS=
PROGRESS_LOG_S = 5.0  # ... and in the log (journald), at most this often while it moves
READY_CHECK_TIMEOUT_S = 5.0


def probe(core: DaemonCore) -> int:
    """One real call through the engine on the loop's thread; returns the pools probed.

    Raises whatever the engine raises, and the failure of any pool's log (a poisoned log
    acknowledges nothing more: a restart is what recovers it).
    """
    pools = core.engine.pool_items()
    for _, dc in pools:
        if dc.wal.failure is not None:
            raise dc.wal.failure
        dc.lookup([0] * dc.layout.block_size)
    return len(pools)


class Lifecycle:
    """The daemon's side of the sd_notify contract (see the module docstring).

    Invariants: READY=1 is sent at most once per serving period (once at start, once after
    each reload); no WATCHDOG=1 is sent unless ``probe`` returned since the previous ping;
    every task it starts is cancelled by ``stopping``.
    """

    def __init__(self, core: DaemonCore, notifier: Notifier | None = None) -> None:
        self.core = core
        self.notifier = notifier if notifier is not None else Notifier(unset_env=True)
        usec = self.notifier.watchdog_usec
        # NOTE: sd_watchdog_enabled(3) asks for a ping at least every half period; a third
        # leaves room for one slow loop turn.
        self.watchdog_period_s = usec / 3e6 if usec else 0.0
        self.pings = 0
        self._tasks: list[asyncio.Task] = []
        self._probe_failed = False

    # -- start -----------------------------------------------------------------------------

    def recovering(self) -> None:
        """Start reporting recovery progress on STATUS= and in the log (until ``serving``)."""
        self._tasks.append(asyncio.create_task(self._report_recovery()))

    async def _report_recovery(self) -> None:
        """STATUS= every ``STATUS_PERIOD_S`` and a log line every ``PROGRESS_LOG_S`` while the
        count moves: a recovery of a big state takes minutes, and an operator reading the
        journal (no ``systemctl status`` at hand) must see it is not stuck."""
        last = None
        logged = time.monotonic()
        while self.core.state == RECOVERING:
            now = (*self.core.progress.as_tuple(), self.core.progress.pools)
            if now != last:
                if self.notifier.enabled:
                    self.notifier.status(recovery_status(*now))
                if time.monotonic() - logged >= PROGRESS_LOG_S:
                    log.info("recovery progress: %s", recovery_status(*now))
                    logged = time.monotonic()
                last = now
            await asyncio.sleep(STATUS_PERIOD_S)

    async def serving(self, socket_paths: list[str]) -> bool:
        """Recovery is done: check every socket answers, then READY=1 and the watchdog loop.
        Returns whether READY was sent (no READY: systemd's start timeout acts)."""
        progress = self.core.progress
        self.notifier.status("recovered: " + recovery_status(*progress.as_tuple(), progress.pools)
                             .removeprefix("recovering: "))
        for path in socket_paths:
            if not await socket_answers(path):
                log.error("a socket does not answer its own health check, not telling systemd "
                          "we are ready path=%s", path)
                return False
        sent = self.notifier.ready(self.serving_status())
        if self.watchdog_period_s:
            self._tasks.append(asyncio.create_task(self._watchdog()))
            log.info("watchdog pings every %.2f s", self.watchdog_period_s)
        return sent

    def serving_status(self) -> str:
        core = self.core
        return (f"serving pools={len(core.engine.pool_items())} sessions={len(core.sessions)}"
                if core.engine is not None else core.state)

    # -- watchdog --------------------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.watchdog_period_s)
            if self.core.state != SERVING:
                continue  # recovering never happens again; stopping cancels this task
            try:
                probe(self.core)
            except Exception as exc:  # noqa: BLE001 - no ping is the report; logged once
                if not self._probe_failed:
                    log.error("watchdog probe failed, no more pings (systemd will restart "
                              "the daemon) error=%r", exc)
                self._probe_failed = True
                continue
            if self._probe_failed:
                log.info("watchdog probe passes again")
                self._probe_failed = False
            self.notifier.send("WATCHDOG=1", f"STATUS={self.serving_status()}")
            self.pings += 1

    # -- reload and stop -------------------------------------------------------------------

    def reloading(self) -> None:
        self.notifier.reloading()

    def reloaded(self, outcome: str) -> None:
        self.notifier.ready(f"{self.serving_status()}; last reload: {outcome}")

    def stopping(self) -> None:
        """STOPPING=1, and no more pings or status reports."""
        self.notifier.stopping()
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()


def recovery_status(replayed: int, total: int, pools: int) -> str:
    """The STATUS= text while recovering."""
    if not total:
        return f"recovering: opening pools ({pools} opened)"
    return (f"recovering: replayed {replayed} of {total} log records "
            f"({100 * replayed // total}%), pools={pools}")


async def socket_answers(path: str, timeout: float = READY_CHECK_TIMEOUT_S) -> bool:
    """Whether a health check through the socket at ``path`` answers SERVING (an aio call: the
    loop that serves it stays free)."""
    try:
        async with grpc.aio.insecure_channel("unix:" + path) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as exc:
        log.warning("health check through own socket failed path=%s error=%s", path, exc)
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
