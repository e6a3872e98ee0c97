"""A connector half's session with the daemon, where any trouble is a miss, never an error.

``DaemonLink.call(what, fn, default)`` runs ``fn(session)`` and answers ``default`` when the
daemon is down, restarting, refusing, or slow past the deadline. The session is made on first
use (vLLM may start before the daemon) and the client library reconnects it by itself after a
restart (``prefixd.client.reconnect``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from prefixd.client.errors import (DaemonRestarted, DeadlineExceeded, InvalidArgument, MappingError, NotFound,
                                   PrefixdError, ResourceExhausted, Unavailable)
from prefixd.client.reconnect import Backoff
from prefixd.client.session import Session, connect

log = logging.getLogger(__name__)

# A daemon that is starting or recovering answers UNAVAILABLE; the library's own wait for it
# is kept this short so that a vLLM step never stalls on it for long (the next try comes after
# ``retry_s``).
CONNECT_BACKOFF = Backoff(initial_s=0.05, max_s=0.2, total_s=0.3)
_OUTAGE = (Unavailable, DeadlineExceeded, NotFound)


@dataclasses.dataclass
class LinkStats:
    """Counters of one link: calls made, calls that failed (any reason), outages begun,
    calls skipped while an outage waited for its retry, restarts seen under a call."""

    calls: int = 0
    failed: int = 0
    outages: int = 0
    skipped: int = 0
    restarts: int = 0


class DaemonLink:
    """One session for one connector half (scheduler or worker).

    State: ``session`` (None until the first successful connect, and after ``close``);
    ``down_since``/``retry_at``: an outage in progress (the first failed call started it, a
    successful call ends it), during which calls before ``retry_at`` are skipped.

    Invariants: at most one session; ``retry_at`` is 0 when no outage is in progress; one
    WARNING per outage and one INFO when it ends.

    NOTE: calls are serialized by a lock: the scheduler side runs on vLLM's engine thread only,
    but ``close`` may come from another (vLLM's shutdown), and a session must not be closed
    under a call.
    """

    def __init__(self, socket: str, layout, name: str, *, mapped: bool, timeout_s: float, retry_s: float,
                 connector=connect) -> None:
        self.socket = socket
        self.layout = layout
        self.name = name
        self.mapped = mapped
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.stats = LinkStats()
        self.session: Session | None = None
        self.down_since = 0.0
        self.retry_at = 0.0
        self._connect = connector
        self._lock = threading.RLock()
        self._closed = False

    def call(self, what: str, fn, default=None):
        """``fn(session)``, or ``default`` when the daemon cannot answer it (counted, logged
        once per outage). Errors that are not the daemon's (a bug here) propagate."""
        with self._lock:
            if self._closed:
                return default
            if self.retry_at and time.monotonic() < self.retry_at:
                self.stats.skipped += 1
                return default
            self.stats.calls += 1
            try:
                session = self._session()
            except (InvalidArgument, MappingError) as exc:
                # the daemon refused this layout, or its pool cannot be mapped here: no retry helps
                self.stats.failed += 1
                self._closed = True
                log.error("prefixd connector disabled (every request is a miss): %s", exc)
                return default
            except _OUTAGE as exc:
                self._failed(what, exc)
                return default
            try:
                result = fn(session)
            except DaemonRestarted as exc:
                self.stats.failed += 1
                self.stats.restarts += 1
                log.info("daemon restarted under %s (answered as a miss) socket=%s error=%s", what, self.socket, exc)
                return default
            except _OUTAGE as exc:
                self._failed(what, exc)
                return default
            except ResourceExhausted as exc:
                self.stats.failed += 1
                log.info("daemon refused %s for room (answered as a miss): %s", what, exc)
                return default
            except PrefixdError as exc:
                self.stats.failed += 1
                log.warning("daemon refused %s (answered as a miss): %s", what, exc)
                return default
            if self.retry_at:
                log.info("daemon answers again socket=%s after=%.1fs failed_calls=%d", self.socket,
                         time.monotonic() - self.down_since, self.stats.failed)
                self.down_since = self.retry_at = 0.0
            return result

    def epoch(self) -> int:
        """The daemon epoch of the current attachment (0 when not attached)."""
        session = self.session
        return session.epoch if session is not None else 0

    @property
    def disabled(self) -> bool:
        """True after ``close`` or a refusal no retry can mend (layout, mapping)."""
        return self._closed

    def close(self) -> None:
        """Detach (the daemon releases what this session still holds). Idempotent."""
        with self._lock:
            self._closed = True
            session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except PrefixdError as exc:
                log.info("detach failed (the lease ends it) error=%s", exc)

    def _session(self) -> Session:
        if self.session is None:
            self.session = self._connect(self.socket, self.layout, name=self.name, mapped=self.mapped,
                                         backoff=CONNECT_BACKOFF, timeout_s=self.timeout_s)
        return self.session

    def _failed(self, what: str, exc: PrefixdError) -> None:
        self.stats.failed += 1
        now = time.monotonic()
        if not self.retry_at:
            self.stats.outages += 1
            self.down_since = now
            log.warning("prefixd daemon unreachable during %s; serving misses, retrying every %.1fs "
                        "socket=%s error=%s", what, self.retry_s, self.socket, exc)
        else:
            log.debug("prefixd daemon still unreachable during %s error=%s", what, exc)
        self.retry_at = now + self.retry_s

    def check_invariants(self) -> None:
        assert (self.retry_at == 0.0) == (self.down_since == 0.0), (self.retry_at, self.down_since)
        assert self.stats.failed >= self.stats.outages
        if self._closed:
            assert self.session is None
