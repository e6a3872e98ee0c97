"""A connector half's session with the daemon, where any trouble is a miss, never an error.

``DaemonLink.call(what, fn, default)`` runs ``fn(session)`` and answers ``default`` when the
daemon is down, restarting, refusing, or slow past the request-path deadline. No call waits
longer than that deadline (``request_timeout_ms``), whatever the daemon does:

- the session is made by a background thread (vLLM may start before the daemon, and the
  first Attach of a layout may take seconds while the daemon makes the pool); a call before it
  is attached waits for it at most the request deadline, then misses;
- the session's circuit breaker (``prefixd.client.breaker``) turns a missed deadline or an
  unreachable daemon into misses answered at once until its probe sees the daemon answer,
  and the probe, not a request, re-attaches after a restart.

Misses for a reason the connector understands are said at WARNING at most once a minute per
reason (``miss_log``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS, DaemonNotAnswering
from prefixd.client.errors import (DaemonRestarted, DeadlineExceeded, InvalidArgument, MappingError, NotFound,
                                   PrefixdError, ResourceExhausted, Unavailable)
from prefixd.client.reconnect import Backoff
from prefixd.client.session import Session, connect
from prefixd.client.vllm import miss_log
from prefixd.client.vllm.miss_log import MissLog

log = logging.getLogger(__name__)

# The library's own wait for a daemon that answers UNAVAILABLE (starting or recovering), on
# the connect thread and the breaker's probe: kept short, the link's thread tries again.
CONNECT_BACKOFF = Backoff(initial_s=0.05, max_s=0.2, total_s=0.3)
_OUTAGE = (Unavailable, DeadlineExceeded, NotFound)


@dataclasses.dataclass
class LinkStats:
    """Counters of one link: calls made, calls that failed (any reason), outages begun,
    calls answered as misses without reaching the daemon (not attached yet, or the breaker
    open), restarts seen under a call, connect attempts that failed."""

    calls: int = 0
    failed: int = 0
    outages: int = 0
    skipped: int = 0
    restarts: int = 0
    connect_failures: int = 0


class DaemonLink:
    """One session for one connector half (scheduler or worker).

    State: ``session`` (None until the connect thread attached, and after ``close``);
    ``_connecting``: the connect thread while it runs; ``down_since``: when the current run
    of failed calls began (0 when the last call was answered).

    Invariants: at most one session and one connect thread; no session after ``close``;
    ``stats.failed >= stats.outages``.

    NOTE: calls are serialized by a lock: the scheduler side runs on vLLM's engine thread only,
    but ``close`` may come from another (vLLM's shutdown), and a session must not be closed
    under a call. The connect thread never holds it while it waits on the daemon.
    """

    def __init__(self, socket: str, layout, name: str, *, mapped: bool, timeout_s: float, retry_s: float,
                 request_timeout_ms: float = DEFAULT_REQUEST_TIMEOUT_MS, max_model_len: int | None = None,
                 connector=connect) -> None:
        self.socket = socket
        self.layout = layout
        self.name = name
        self.mapped = mapped
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.request_timeout_ms = request_timeout_ms
        self.max_model_len = max_model_len
        self.stats = LinkStats()
        self.misses = MissLog()
        self.session: Session | None = None
        self.down_since = 0.0
        self._connect = connector
        self._lock = threading.RLock()
        self._attached = threading.Event()
        self._connecting: threading.Thread | None = None
        self._closed = False

    def start(self, wait_s: float = 0.0) -> bool:
        """Begin attaching in the background (if not attached or attaching) and wait for it
        at most ``wait_s``; True when attached."""
        if self._closed:
            return False
        with self._lock:
            if self.session is None and (self._connecting is None or not self._connecting.is_alive()):
                self._connecting = threading.Thread(target=self._connect_loop, name=f"prefixd-connect-{self.name}",
                                                    daemon=True)
                self._connecting.start()
        return self._attached.wait(wait_s) if wait_s > 0 else self._attached.is_set()

    def call(self, what: str, fn, default=None):
        """``fn(session)``, or ``default`` when the daemon cannot answer it within the request
        deadline (counted; logged at WARNING at most once a minute per reason). Errors that
        are not the daemon's (a bug here) propagate."""
        if self._closed:
            return default
        # the first attempt may take up to the request deadline; after one failed, none waits
        first_wait = self.request_timeout_ms / 1000 if not self.stats.connect_failures else 0.0
        if self.session is None and not self.start(first_wait):
            self.stats.skipped += 1
            self._miss(self._absent_reason(), f"not attached yet (socket={self.socket})")
            return default
        with self._lock:
            session = self.session
            if self._closed or session is None:
                return default
            self.stats.calls += 1
            try:
                result = fn(session)
            except DaemonNotAnswering as exc:
                self.stats.skipped += 1
                self._miss(miss_log.UNREACHABLE, exc)
                return default
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
                self._miss(miss_log.POOL_FULL, exc)
                return default
            except PrefixdError as exc:
                self.stats.failed += 1
                log.warning("daemon refused %s (answered as a miss): %s", what, exc)
                return default
            if self.down_since:
                log.info("daemon answers again socket=%s after=%.1fs failed_calls=%d", self.socket,
                         time.monotonic() - self.down_since, self.stats.failed)
                self.down_since = 0.0
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
            self._attached.clear()
        if session is not None:
            try:
                session.close()
            except PrefixdError as exc:
                log.info("detach failed (the lease ends it) error=%s", exc)

    # -- helpers ---------------------------------------------------------------------------

    def _connect_loop(self) -> None:
        """The connect thread: Attach until it works (backing off to ``retry_s``), the link
        closes, or the daemon refuses for good (layout, mapping)."""
        wait = 0.05
        while not self._closed:
            try:
                session = self._connect(self.socket, self.layout, name=self.name, mapped=self.mapped,
                                        backoff=CONNECT_BACKOFF, timeout_s=self.timeout_s,
                                        request_timeout_ms=self.request_timeout_ms,
                                        **({"max_model_len": self.max_model_len} if self.max_model_len else {}))
            except (InvalidArgument, MappingError) as exc:
                # the daemon refused this layout, or its pool cannot be mapped here: no retry helps
                self._closed = True
                log.error("prefixd connector disabled (every request is a miss): %s", exc)
                return
            except ResourceExhausted as exc:
                self.stats.connect_failures += 1
                self._miss(miss_log.POOL_TOO_SMALL, exc)
            except PrefixdError as exc:
                self.stats.connect_failures += 1
                self._miss(self._absent_reason(), exc)
            else:
                with self._lock:
                    if not self._closed:
                        self.session = session
                        self._attached.set()
                        return
                session.close()
                return
            time.sleep(wait)
            wait = min(self.retry_s, wait * 2)

    def _absent_reason(self) -> str:
        return miss_log.UNREACHABLE if os.path.exists(self.socket) else miss_log.SOCKET_ABSENT

    def _miss(self, reason: str, detail) -> None:
        self.misses.record(reason, detail)

    def _failed(self, what: str, exc: PrefixdError) -> None:
        self.stats.failed += 1
        if not self.down_since:
            self.stats.outages += 1
            self.down_since = time.monotonic()
        self._miss(miss_log.UNREACHABLE, f"{what}: {exc}")

    def check_invariants(self) -> None:
        assert self.stats.failed >= self.stats.outages
        self.misses.check_invariants()
        if self._closed:
            assert self.session is None
        session = self.session
        if session is not None and getattr(session, "breaker", None) is not None:
            session.breaker.check_invariants()
