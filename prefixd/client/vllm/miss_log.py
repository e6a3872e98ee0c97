"""Misses the connector understands, said at WARNING at a low rate instead of once per request.

A connector that keeps missing for one reason (no daemon socket, a daemon that does not
answer, a pool too small for a prompt) would otherwise log a line per request, or only at the
start of an outage. ``MissLog.record(reason, detail)`` counts the calls each reason turned
into a miss and logs one WARNING per reason at most every ``interval_s``, with the count since
the last line and the latest detail (which names what to do).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

SOCKET_ABSENT = "socket absent"
UNREACHABLE = "daemon unreachable"
POOL_TOO_SMALL = "pool too small"
POOL_FULL = "pool full"


@dataclasses.dataclass
class ReasonCount:
    """Calls missed for one reason: in all, since the last WARNING, and when that was."""

    total: int = 0
    since_logged: int = 0
    logged_at: float | None = None


class MissLog:
    """Per-reason counters and the time of each reason's last WARNING.

    Invariants: ``since_logged <= total`` per reason; a reason logs at most once per
    ``interval_s`` (its first miss always logs).
    """

    def __init__(self, interval_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.reasons: dict[str, ReasonCount] = {}
        self._clock = clock

    def record(self, reason: str, detail: object) -> bool:
        """Count one call missed for ``reason``; True when this one logged."""
        c = self.reasons.setdefault(reason, ReasonCount())
        c.total += 1
        c.since_logged += 1
        now = self._clock()
        if c.logged_at is not None and now - c.logged_at < self.interval_s:
            return False
        log.warning("prefixd connector serving misses reason=%s calls=%d (in the last %ds) detail=%s", reason,
                    c.since_logged, int(self.interval_s), detail)
        c.since_logged = 0
        c.logged_at = now
        return True

    def check_invariants(self) -> None:
        for reason, c in self.reasons.items():
            assert 0 <= c.since_logged <= c.total, (reason, c)
