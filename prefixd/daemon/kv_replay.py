"""The replay side of vLLM's ZMQ KV-event protocol, on a thread of its own.

A subscriber that missed batches (a gap in the sequence numbers, or a first connection) sends
its tenant's ROUTER socket one frame, the first number it wants (8 bytes, big-endian), as a
DEALER or REQ; it gets back every batch of the replay buffer numbered from there, each as
``[b"", topic, seq, payload]``, then the end marker ``[b"", b"", END_SEQ, b""]``
(``prefixd.daemon.kv_wire``). A request of another shape is logged and answered with the end
marker alone.

NOTE: replays run here, not on the loop: a replay of the whole buffer is thousands of sends,
and a subscriber asking for one must never delay a cache call. The buffer is the publisher's
``deque``, appended on the loop's thread; ``list(deque)`` copies it in one step under the GIL,
so a replay reads a consistent prefix of it. The ROUTER sockets are used by this thread only
(bound on the loop's thread before it starts, as zmq allows a socket to change threads).
"""

from __future__ import annotations

import logging
import threading

import zmq

from prefixd.daemon.kv_wire import END_SEQ, seq_bytes

log = logging.getLogger(__name__)


class ReplayServer:
    """Answers replay requests on every publisher's ROUTER socket (``publishers``: each has
    ``replay``, ``topic``, ``buffer``, ``tenant``) until ``stop``. Counts ``requests`` and
    ``replayed`` (batches sent) per tenant.

    NOTE: the thread sleeps in its poll until a request or ``stop`` comes (an inproc PAIR
    socket wakes it), never on a timer: a thread that woke every tenth of a second would take
    the GIL from the loop's thread ten times a second for nothing."""

    def __init__(self, ctx, publishers) -> None:
        self._ctx = ctx
        self._publishers = {id(p.replay): p for p in publishers}
        self._sockets = [p.replay for p in publishers]
        self.requests = {p.tenant: 0 for p in publishers}
        self.replayed = {p.tenant: 0 for p in publishers}
        self._wake = self._woken = None  # the PAIR ends: ``stop`` sends, the thread hears
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._sockets and self._thread is None:
            address = f"inproc://prefixd-kv-replay-{id(self)}"
            self._woken = self._ctx.socket(zmq.PAIR)
            self._woken.bind(address)
            self._wake = self._ctx.socket(zmq.PAIR)
            self._wake.connect(address)
            self._thread = threading.Thread(target=self._run, name="prefixd-kv-replay",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._wake.send(b"")
            self._thread.join()
            self._thread = None
            self._wake.close(0)
            self._woken.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._woken, zmq.POLLIN)
        while True:
            try:
                for sock, _ in poller.poll():
                    if sock is self._woken:
                        return
                    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._answer(self._publishers[id(sock)], sock.recv_multipart())
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - the next request is still answered
                log.exception("kv events replay failed")

    def _answer(self, pub, frames: list[bytes]) -> None:
        sock = pub.replay
        ident = frames[0]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events replay request refused (want [empty, 8-byte big-endian "
                        "sequence number]) tenant=%s frames=%d", pub.tenant, len(frames))
            sock.send_multipart((ident, b"", b"", END_SEQ, b""))
            return
        start = int.from_bytes(frames[2], "big")
        self.requests[pub.tenant] += 1
        sent = 0
        for seq, payload in list(pub.buffer):
            if seq >= start:
                sock.send_multipart((ident, b"", pub.topic, seq_bytes(seq), payload))
                sent += 1
        sock.send_multipart((ident, b"", b"", END_SEQ, b""))
        self.replayed[pub.tenant] += sent
        log.info("kv events replay tenant=%s from=%d batches=%d", pub.tenant, start, sent)
