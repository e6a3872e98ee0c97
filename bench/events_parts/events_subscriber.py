"""The router's side of ``bench/events.py``: a ZMQ subscriber to the publishing daemon's
KV-event batches, what it received, and when.

Receipt runs on a thread of the bench's process (a SUB socket with no high-water mark, so
nothing is dropped on this side); decoding waits for ``drain`` between rounds, off the
measured seconds. The lag of a commit is read from ``seen``: the receipt time of the
``BlockStored`` on the GPU of each prompt's last full block, keyed by its token ids.
"""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import zmq

from events_load import BS


class Subscriber:
    """Reads every batch of ``endpoint`` on a thread, keeping ``(receipt time, seq, payload)``;
    ``drain`` decodes what came (between rounds: the router's work stays off the measured
    seconds, which share two cores with it), keeping the receipt time of each ``BlockStored``
    on the GPU by its last block's token ids, and counting what came inside a window."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.raw: list = []
        self.events = self.batches = 0
        self.window_events = self.window_batches = 0
        self.seen: dict[bytes, float] = {}
        self.last_seq = None
        self.gaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock, clock, keep = self.sock, time.time, self.raw.append
        while not self._stop.is_set():
            if sock.poll(50):
                _, seq_b, payload = sock.recv_multipart()
                keep((clock(), seq_b, payload))

    def drain(self, window: tuple[float, float] = (0.0, 0.0)) -> None:
        """Decodes what came; batches received in ``window`` (wall clock) count in
        ``window_events`` / ``window_batches``."""
        raw, self.raw[:] = list(self.raw), []
        for now, seq_b, payload in raw:
            seq = int.from_bytes(seq_b, "big")
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = seq
            _, events, _ = msgpack.unpackb(payload)
            self.batches += 1
            self.events += len(events)
            if window[0] <= now <= window[1]:
                self.window_batches += 1
                self.window_events += len(events)
            for e in events:
                if e["type"] == "BlockStored" and e["medium"] == "GPU" and e["token_ids"]:
                    key = np.asarray(e["token_ids"][-BS:], dtype="<i4").tobytes()
                    self.seen.setdefault(key, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(0)
        self.ctx.term()
