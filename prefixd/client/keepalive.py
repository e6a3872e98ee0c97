"""The lease: a background thread holding the session's ``KeepAlive`` stream.

The daemon ends a session when its KeepAlive stream ends or no ping came for a whole lease
(prefixd.proto). ``KeepAlive`` sends a ping every ``lease_s / 3`` (or ``renew_s``) on one
long-lived bidirectional stream and reads the replies (a reply may change the lease).

It stops in two ways:

- ``stop()`` (detach, or the session re-attaching): the request iterator ends, the call is
  cancelled, the thread is joined; ``on_lost`` is not called.
- the stream breaks by itself (daemon killed or restarted, lease lapsed): ``on_lost(error)`` is
  called once, from the thread, with the typed error, so the session can reconnect.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.client.errors import PrefixdError, Unavailable, from_rpc_error

log = logging.getLogger(__name__)


class KeepAlive:
    """One session's KeepAlive stream on a daemon thread.

    Invariants: at most one stream per instance; after ``stop()`` returns the thread has ended
    and ``on_lost`` will not be called; ``on_lost`` is called at most once.
    """

    def __init__(self, stub, session_id: int, lease_s: float, on_lost: Callable[[PrefixdError], None],
                 *, renew_s: float | None = None) -> None:
        self._stub = stub
        self._session_id = session_id
        self.lease_s = lease_s
        self._renew_s = renew_s
        self._on_lost = on_lost
        self._stopping = threading.Event()
        self._call = None
        self.pings = 0
        self.replies = 0
        self.lost: PrefixdError | None = None  # set (once) when the stream broke by itself
        self.lost_before_stop = False
        self._thread = threading.Thread(target=self._run, name=f"prefixd-keepalive-{session_id:x}", daemon=True)

    @property
    def interval_s(self) -> float:
        third = self.lease_s / 3 if self.lease_s > 0 else 1.0
        return min(self._renew_s, third) if self._renew_s else third

    def start(self) -> "KeepAlive":
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _requests(self):
        while not self._stopping.is_set():
            self.pings += 1
            yield pb.KeepAliveRequest(session_id=self._session_id)
            self._stopping.wait(self.interval_s)

    def _run(self) -> None:
        error: PrefixdError | None = None
        try:
            self._call = self._stub.KeepAlive(self._requests())
            if self._stopping.is_set():
                self._call.cancel()
            for reply in self._call:
                self.replies += 1
                if reply.lease_s > 0:
                    self.lease_s = reply.lease_s
            error = Unavailable(f"the daemon ended session {self._session_id:#x}'s KeepAlive stream")
        except grpc.RpcError as exc:
            if not self._stopping.is_set():
                error = from_rpc_error(exc)
        except Exception as exc:  # noqa: BLE001 - the thread must report, not die silently
            error = Unavailable(f"KeepAlive stream failed: {exc!r}")
        if self._stopping.is_set():
            return
        self.lost, self.lost_before_stop = error, True
        log.warning("keepalive stream lost session=%#x error=%s", self._session_id, error)
        try:
            self._on_lost(error)
        except Exception:  # noqa: BLE001
            log.exception("keepalive on_lost callback failed session=%#x", self._session_id)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the stream and join the thread (idempotent)."""
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def check_invariants(self) -> None:
        assert self.interval_s > 0, self.lease_s
        assert self.lost is None or self.lost_before_stop, "on_lost only for a stream we did not stop"
