"""A circuit breaker for one session: while the daemon does not answer, calls fail at once.

A call that misses its deadline, or finds the daemon unreachable, *trips* the breaker. While
it is open, ``allow()`` is False and the session raises ``DaemonNotAnswering`` (an
``Unavailable``) before sending anything, so a caller on a latency path (vLLM's engine thread)
pays the request deadline once per outage, not once per request. A background thread probes
the daemon with a cheap call under its own short deadline, backing off between tries; the
first probe the daemon answers closes the breaker.

    breaker = Breaker(probe=lambda: daemon_answers(), name="session-1")
    if not breaker.allow():
        raise breaker.error("lookup")
    try:
        call()
    except (DeadlineExceeded, Unavailable) as exc:
        breaker.trip(exc)
        raise

NOTE: a probe, not a half-open trial call: the trial would be a request on the caller's
thread and would pay the deadline again while the daemon is still hung. The probe thread pays
it instead, where nobody waits.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from prefixd.client.errors import Unavailable

log = logging.getLogger(__name__)

# NOTE: 1 s: twice the worst call of a healthy daemon on two loaded cores (~0.5 s, where
# the p99 is ~80 ms), so a daemon that is only slow does not trip the breaker, while a hung one
# costs one call 1 s once per outage (docs/design.md, "When the daemon does not answer").
DEFAULT_REQUEST_TIMEOUT_MS = 1000.0


class DaemonNotAnswering(Unavailable):
    """Refused locally: the session's breaker is open (the daemon missed a deadline or was
    unreachable, and no probe has seen it answer since). Nothing was sent; treat it as a miss."""


@dataclasses.dataclass(frozen=True)
class ProbeSchedule:
    """Waits between probes: ``initial_s``, times ``multiplier`` after each unanswered probe, at
    most ``max_s``. A probe itself is bounded by the prober's own deadline.

    Raises:
        ValueError: on construction, for ``initial_s <= 0``, ``max_s < initial_s`` or
            ``multiplier < 1``.
    """

    initial_s: float = 0.05
    max_s: float = 0.5
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.multiplier < 1:
            raise ValueError(f"probe schedule needs 0 < initial_s <= max_s and multiplier >= 1; got {self}")

    def next_wait(self, wait: float) -> float:
        return min(self.max_s, wait * self.multiplier)


@dataclasses.dataclass
class BreakerStats:
    """Trips (closed -> open), calls refused while open, probes sent, probes answered."""

    trips: int = 0
    refused: int = 0
    probes: int = 0
    answered: int = 0


class Breaker:
    """Closed (calls go through) or open (calls refused, one probe thread running).

    ``probe()`` returns True when the daemon answered (it may also do work that must come
    before calls resume, such as re-attaching after a restart) and False when it did not; an
    exception from it counts as not answered. ``on_close()`` runs after a probe closed it.

    Invariants: ``open`` iff ``opened_at > 0``; a probe thread runs only while open (or is
    finishing the probe that closes it); ``stats.answered <= stats.probes``; after ``stop()``
    no probe starts and ``allow()`` stays as it was.
    """

    def __init__(self, probe: Callable[[], bool], *, name: str = "", schedule: ProbeSchedule | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self.name = name
        self.schedule = schedule or ProbeSchedule()
        self.stats = BreakerStats()
        self.opened_at = 0.0
        self.last_error: Exception | None = None
        self._clock = clock
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def open(self) -> bool:
        return self.opened_at > 0

    def allow(self) -> bool:
        """True when calls may go to the daemon; False (counted) while open."""
        if self.opened_at == 0.0:  # unlocked read: the hot path of every call
            return True
        with self._cond:
            if self.opened_at:
                self.stats.refused += 1
                return False
            return True

    def error(self, what: str) -> DaemonNotAnswering:
        """The error a refused call raises (names the call, the outage's age and cause)."""
        age = self._clock() - self.opened_at if self.opened_at else 0.0
        return DaemonNotAnswering(f"{what} not sent: the daemon {self.name} has not answered for {age:.1f} s "
                                  f"(last error: {self.last_error}); a background probe retries")

    def trip(self, error: Exception) -> bool:
        """Open the breaker (if closed) and start the probe; True when this call opened it."""
        with self._cond:
            self.last_error = error
            if self.opened_at or self._stopped:
                return False
            self.opened_at = max(self._clock(), 1e-9)
            self.stats.trips += 1
            self._thread = threading.Thread(target=self._run, name=f"prefixd-probe-{self.name}", daemon=True)
            self._thread.start()
        log.warning("daemon not answering, failing calls fast until a probe sees it answer name=%s error=%s",
                    self.name, error)
        return True

    def wait_closed(self, timeout_s: float) -> bool:
        """Block until closed (or ``timeout_s``); True when closed. For tests and tools."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.opened_at and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not self.opened_at

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the probe thread (idempotent); the session is closing."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        wait = self.schedule.initial_s
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped, wait)
                if self._stopped:
                    return
                self.stats.probes += 1
            try:
                answered = bool(self._probe())
            except Exception as exc:  # noqa: BLE001 - a failed probe is "not answered"
                log.debug("probe failed name=%s error=%s", self.name, exc)
                answered = False
            if answered:
                with self._cond:
                    self.stats.answered += 1
                    down_s = self._clock() - self.opened_at
                    self.opened_at = 0.0
                    self._thread = None
                    self._cond.notify_all()
                log.warning("daemon answers again, calls resume name=%s after=%.1fs refused=%d", self.name,
                            down_s, self.stats.refused)
                return
            wait = self.schedule.next_wait(wait)

    def check_invariants(self) -> None:
        assert self.opened_at >= 0
        assert self.stats.answered <= self.stats.probes, self.stats
        assert self.stats.answered <= self.stats.trips, self.stats
        if not self.opened_at:
            assert self.stats.trips == self.stats.answered or self._stopped, self.stats
