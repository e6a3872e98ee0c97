"""A ZMQ subscriber of the daemon's KV events (vLLM's wire format) for tests: every batch, in
order, exactly once, the gaps filled by vLLM's replay protocol, on a thread of its own.

``KVSub(endpoint, replay_endpoint)`` connects (before or after the daemon binds: ZMQ
reconnects) and keeps ``batches``: ``(seq, payload)`` in order. The first message, and any
number past the last one plus one (a batch dropped, or a daemon restart: numbers start at the
start's clock), make it ask the ROUTER for every kept batch from the last number plus one (0
at first); ``lost`` counts numbers a replay could not give back. ``skip_live(n)`` drops the
next ``n`` live messages on purpose (a window to be replayed).
"""

from __future__ import annotations

import threading
import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode(payload: bytes):
    """``(ts, events, data_parallel_rank)`` of a ``KVEventBatch`` payload (events as dicts)."""
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return ts, events, rank


class KVSub:
    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"",
                 on_batch=None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.on_batch = on_batch  # called with (seq, payload) on the thread, in order
        self.batches: list[tuple[int, bytes]] = []
        self.topics: set[bytes] = set()
        self.last: int | None = None
        self.lost = 0
        self.replays = 0
        self.replayed = 0
        self.received = 0
        self._skip = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def skip_live(self, n: int) -> None:
        with self.lock:
            self._skip = n

    def wait(self, cond, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self.error is not None:
                    raise AssertionError(f"the subscriber failed: {self.error!r}")
                if cond(self):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"subscriber: {what} not reached after {timeout} s "
                                     f"(batches={len(self.batches)} last={self.last})")
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sub.close(0)
        self.ctx.term()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sub.poll(50):
                    continue
                topic, seq_b, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                with self.lock:
                    self.received += 1
                    self.topics.add(topic)
                    if self._skip:
                        self._skip -= 1
                        continue
                    if self.last is None or seq > self.last + 1:
                        self._replay(0 if self.last is None else self.last + 1)
                    self._apply(seq, payload)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            return  # had it already (live after its replay)
        if self.last is not None and seq != self.last + 1 and self.batches:
            # only a restart's numbers may jump, and then its first batch is AllBlocksCleared
            if decode(payload)[1][:1] != [{"type": "AllBlocksCleared"}]:
                self.lost += seq - self.last - 1
        self.batches.append((seq, payload))
        self.last = seq
        if self.on_batch is not None:
            self.on_batch(seq, payload)

    def _replay(self, start: int) -> None:
        self.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not sock.poll(30_000):
                    raise AssertionError(f"no end marker 30 s after a replay request from {start}")
                frames = sock.recv_multipart()
                if frames[2] == END_SEQ:
                    assert frames == [b"", b"", END_SEQ, b""], frames
                    return
                _, topic, seq_b, payload = frames
                assert topic == self.topic or not self.topic, (topic, self.topic)
                self.replayed += 1
                self._apply(int.from_bytes(seq_b, "big"), payload)
        finally:
            sock.close(0)
