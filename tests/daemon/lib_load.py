"""A load client of the kill -9 suite through the client library (``prefixd.client``).

The same gsp-like requests and the same ack and event lines as ``gsp_load.LoadClient``, but
through ``connect`` / ``Session``: the KV goes through the mapped device pool when the process
can map it, and after a daemon restart the library itself attaches again, Reclaims and updates
the handles. The client checks what the library gave back: the sequence it held (commit
acknowledged, release not sent) is ``reclaimed`` with at least its committed tokens, and
``read_kv`` of them gives the bytes it wrote. Every other live handle is released then.
"""

from __future__ import annotations

import os
import random
import time

import torch

import prefixd.client as pc
from tests.daemon.gsp_workload import BS, LAYOUT, digest, kv_of, systems
from tests.daemon.json_lines import Log


class LibClient:
    """One client through ``prefixd.client`` (``run`` forever); ``held`` is ``(Sequence, ack)``
    of the last commit acknowledged and not released, or None."""

    def __init__(self, socket: str, out_dir: str, index: int, seed: int, think_s: float) -> None:
        while not os.path.exists(socket):  # connect retries a daemon that is not up yet, but
            time.sleep(0.05)  # not a socket path that does not exist (yet)
        self.session = pc.connect(socket, pc.KVLayout(**LAYOUT), f"lib-{index}",
                                  backoff=pc.Backoff(total_s=600.0))
        self.acks = Log(os.path.join(out_dir, f"acks-{index}"))
        self.events = Log(os.path.join(out_dir, f"events-{index}"))
        self.rng = random.Random(seed)
        self.think_s = think_s
        self.systems = systems()
        self.held = None
        self.session_id = self.session.id

    def run(self) -> None:
        while True:
            try:
                self.request()
            except pc.DaemonRestarted:
                pass
            if self.session.id != self.session_id:  # the library attached again
                self.after_restart()
            time.sleep(self.rng.random() * self.think_s)

    def request(self) -> None:
        tokens = self.rng.choice(self.systems) + [self.rng.randrange(50000)
                                                  for _ in range(self.rng.randint(8, 56))]
        if len(tokens) % BS == 0:
            tokens.append(self.rng.randrange(50000))
        s = self.session
        seq = s.open(tokens)
        c = seq.cached_tokens
        s.write_kv(seq, c, torch.from_numpy(kv_of(tokens, c, len(tokens) - c)))
        full = len(tokens) // BS * BS
        ack = {"session": s.id, "seq": seq.id, "tokens": tokens, "full": full,
               "digest": digest(kv_of(tokens, 0, full).tobytes())}
        if self.rng.random() < 0.5:
            s.commit(seq, "crash")
            self.acks.add(dict(ack, via="lib-commit"))
            old, self.held = self.held, (seq, ack)
            if old is not None:
                s.release(old[0])
        else:
            s.release(seq, commit=True, durability="crash")
            self.acks.add(dict(ack, via="lib-release"))

    def after_restart(self) -> None:
        """Check the held sequence came back whole, release every live handle, log one event."""
        bad = []
        held, self.held = self.held, None
        if held is not None and held[1]["session"] == self.session.id:
            # NOTE: opened after the restart (an open is retried after a recovery): no Reclaim
            # was owed for it, so it is neither reclaimed nor lost; it is still released below.
            held = None
        if held is not None:
            seq, ack = held
            deadline = time.monotonic() + 60
            while not (seq.reclaimed or seq.lost) and time.monotonic() < deadline:
                time.sleep(0.01)  # the new session id shows once the handles are updated: a bound
            if seq.lost or not seq.reclaimed or seq.num_tokens < ack["full"]:
                bad.append(f"held sequence ({ack['full']} tokens acknowledged) came back lost="
                           f"{seq.lost} reclaimed={seq.reclaimed} with {seq.num_tokens} tokens")
            else:
                data = self._retry(lambda: self.session.read_kv(seq, 0, ack["full"]))
                if digest(data.contiguous().numpy().tobytes()) != ack["digest"]:
                    bad.append("held sequence came back with other KV bytes")
        for seq in list(self.session.sequences):
            self._retry(lambda seq=seq: self.session.release(seq))
        self.events.add({"reclaim": self.session_id, "session": self.session.id,
                         "held": int(held is not None), "returned": None, "lenient": False,
                         "bad": bad, "lib": True})
        self.session_id = self.session.id

    def _retry(self, call):
        """``call()``; a handle changed by a recovery raises DaemonRestarted once: call again."""
        for _ in range(5):
            try:
                return call()
            except pc.DaemonRestarted:
                continue
        return call()
