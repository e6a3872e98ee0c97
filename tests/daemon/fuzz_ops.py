"""The ``Fuzzer`` of ``test_fuzz.py``: makes the calls that ``fuzz_draw`` draws, resolved
against what it knows of the daemon, and checks every answer.

The live ids exist only at run time: a "live" session id is one the fuzzer attached, a "stale"
one was detached, expired or is from before a restart, "other" belongs to the other tenant.
Valid calls happen too (they are what reaches the deep checks), and the fuzzer keeps a model of
what they did: the tokens of every sequence it holds, and every full block that a successful
Commit, Release(commit) or Fork (which indexes the parent's full blocks) put in the index, as
a set of block-aligned token prefixes per layout. Each Commit's ``indexed_blocks`` and each
reply's sequence length must match the model, and at the end the daemon's count must too:
that is how the test sees from outside that refused calls changed nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import grpc
import numpy as np

from prefixd.api import prefixd_pb2 as pb
from tests.daemon.fuzz_draw import (ALT_LAYOUTS, BASE, HUGE_LAYOUTS, LAYOUT, MAX_LIVE_SESSIONS,
                                     MAX_MESSAGE, MAX_SEQS, U64)

Code = grpc.StatusCode
ALLOWED = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED,
           Code.FAILED_PRECONDITION, Code.UNAVAILABLE, Code.OUT_OF_RANGE, Code.UNIMPLEMENTED}


@dataclasses.dataclass
class Held:
    """A session the fuzzer attached: its layout, and its sequences' tokens (None: unknown)."""

    id: int
    layout: pb.KVLayout
    seqs: dict[int, bytes | None] = dataclasses.field(default_factory=dict)


class BadStatus(AssertionError):
    pass


class Fuzzer:
    """Makes the calls of drawn ops on one socket (``stub``) and keeps the model.

    ``other`` is a stub on the other tenant's socket (its sessions are the "other" ids);
    ``previous`` are session ids of before a restart (for Reclaim and as stale ids).
    """

    def __init__(self, stub, other, previous: list[int], indexed: dict[str, set[bytes]]):
        self.stub, self.other = stub, other
        self.live: list[Held] = []
        self.stale: list[int] = list(previous)
        self.previous = list(previous)
        self.released: collections.deque[int] = collections.deque(maxlen=64)
        self.other_ids = [other.Attach(pb.AttachRequest(client_name="fuzz-other",
                                                        layout=LAYOUT)).session_id]
        self.indexed = indexed  # layout key -> block-aligned token prefixes in the index
        self.calls: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self.oversize = np.arange(MAX_MESSAGE // 4 + 1, dtype="<i4").tobytes()

    # -- resolving drawn values --------------------------------------------------------------

    def session(self, choice) -> Held | int:
        kind, k = choice
        if kind == "live":
            if not self.live:
                self.attach(LAYOUT)
            return self.live[k % len(self.live)]
        if kind == "stale" and self.stale:
            return self.stale[k % len(self.stale)]
        if kind == "other":
            return self.other_ids[k % len(self.other_ids)]
        return {"zero": 0, "max": U64}.get(kind, k)

    def seq_id(self, held, choice) -> int:
        kind, k = choice
        if kind == "own" and isinstance(held, Held) and held.seqs:
            return list(held.seqs)[k % len(held.seqs)]
        if kind == "released" and self.released:
            return self.released[k % len(self.released)]
        if kind == "foreign":
            seqs = [s for h in self.live if h is not held for s in h.seqs]
            if seqs:
                return seqs[k % len(seqs)]
        return {"zero": 0, "max": U64}.get(kind, k)

    def tokens(self, choice) -> bytes:
        kind = choice[0]
        if kind == "base":
            _, i, n, tail = choice
            return BASE[i][:n].tobytes() + np.asarray(tail, dtype="<i4").tobytes()
        if kind in ("ragged", "random"):
            return choice[1]
        if kind == "large":
            return np.arange(500_000, 500_000 + choice[1], dtype="<i4").tobytes()
        if kind == "extremes":
            return np.array([2**31 - 1, -2**31, -1, 0], dtype="<i4").tobytes()
        if kind == "oversize":
            return self.oversize
        return b""

    def tensor(self, drawn, right_shape, layout) -> pb.Tensor:
        shp, dt, n = drawn
        shp = right_shape if shp == "right" else shp
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dt, 1)
        n = int(np.prod(shp, dtype=object)) * itemsize if n == "right" else n
        return pb.Tensor(shape=shp, dtype=dt, data=bytes(min(n, 1 << 16)))

    @staticmethod
    def sid_of(held) -> int:
        return held.id if isinstance(held, Held) else held

    # -- calls ---------------------------------------------------------------------------------

    def call(self, name: str, fn, *args):
        """``fn(*args)``; a refusal is returned as its code, checked to be one of ``ALLOWED``."""
        self.calls[name] += 1
        t0 = time.perf_counter()
        try:
            reply = fn(*args)
        except grpc.RpcError as err:
            self.seconds[name] += time.perf_counter() - t0
            code = err.code()
            self.codes[code.name] += 1
            if code not in ALLOWED:
                raise BadStatus(f"{name} answered {code.name}: {err.details()}") from None
            return code
        self.seconds[name] += time.perf_counter() - t0
        self.codes["OK"] += 1
        return reply

    def attach(self, layout_msg, name: str = "fuzz"):
        reply = self.call("Attach", self.stub.Attach, pb.AttachRequest(client_name=name,
                                                                       layout=layout_msg))
        if isinstance(reply, pb.AttachReply):
            self.live.append(Held(reply.session_id, layout_msg))
            while len(self.live) > MAX_LIVE_SESSIONS:
                self.detach(self.live[0])
        return reply

    def detach(self, held: Held) -> None:
        self.call("Detach", self.stub.Detach, pb.DetachRequest(session_id=held.id))
        self.ended(held)

    def ended(self, held: Held) -> None:
        if held in self.live:
            self.live.remove(held)
        self.released.extend(held.seqs)
        self.stale.append(held.id)
        del self.stale[:-32]

    def committed(self, held: Held, seq_id: int) -> int:
        """Add the sequence's full blocks to the model's index; returns how many were new."""
        toks = held.seqs.get(seq_id)
        index = self.indexed.setdefault(layout_key(held.layout), set())
        step = 4 * held.layout.block_size
        before = len(index)
        index.update(toks[:k * step] for k in range(1, len(toks) // step + 1))
        return len(index) - before

    def check_reply(self, name: str, held: Held, seq: pb.SequenceReply) -> None:
        """The daemon's idea of a sequence's length must be the model's."""
        toks = held.seqs.get(seq.seq_id)
        if toks is not None and seq.num_tokens != len(toks) // 4:
            raise BadStatus(f"{name}: sequence {seq.seq_id} has {seq.num_tokens} tokens, the "
                            f"model says {len(toks) // 4}")

    def run(self, name: str, args) -> None:
        getattr(self, "op_" + name)(*args)


    def op_Attach(self, lay, name):
        if lay == "main":
            msg = LAYOUT
        elif isinstance(lay, int):
            msg = ALT_LAYOUTS[lay]
        elif isinstance(lay, tuple):
            msg = HUGE_LAYOUTS[lay[1]]
        else:
            msg = lay
        if msg is None:
            self.call("Attach", self.stub.Attach, pb.AttachRequest(client_name=name))
        else:
            self.attach(msg, name)

    def op_Detach(self, s):
        held = self.session(s)
        reply = self.call("Detach", self.stub.Detach, pb.DetachRequest(session_id=self.sid_of(held)))
        if isinstance(held, Held) and isinstance(reply, pb.DetachReply):
            self.ended(held)

    def op_KeepAlive(self, s, more):
        held = self.session(s)
        pings = [pb.KeepAliveRequest(session_id=self.sid_of(x))
                 for x in [held] + [self.session(m) for m in more]]
        self.call("KeepAlive", lambda: list(self.stub.KeepAlive(iter(pings), timeout=10)))
        if isinstance(held, Held) and held in self.live:
            self.ended(held)  # its stream ended: so did the session

    def op_Reclaim(self, s, prev):
        held = self.session(s)
        if prev[0] == "previous" and self.previous:
            prev_id = self.previous[prev[1] % len(self.previous)]
        else:
            prev_id = self.sid_of(self.session(prev))
        reply = self.call("Reclaim", self.stub.Reclaim, pb.ReclaimRequest(
            session_id=self.sid_of(held), previous_session_id=prev_id))
        if isinstance(reply, pb.ReclaimReply) and isinstance(held, Held):
            for item in reply.sequences:
                if item.seq_id:
                    held.seqs[item.seq_id] = item.tokens

    def op_Lookup(self, s, t):
        self.call("Lookup", self.stub.Lookup, pb.LookupRequest(
            session_id=self.sid_of(self.session(s)), tokens=self.tokens(t)))

    def op_Open(self, s, t):
        held = self.session(s)
        if isinstance(held, Held) and len(held.seqs) >= MAX_SEQS:
            self.op_Release(s, ("own", 0), False, "")
        toks = self.tokens(t)
        reply = self.call("Open", self.stub.Open, pb.OpenRequest(session_id=self.sid_of(held),
                                                                 tokens=toks))
        if isinstance(reply, pb.OpenReply) and isinstance(held, Held):
            held.seqs[reply.sequence.seq_id] = toks

    def op_Extend(self, s, q, t):
        held = self.session(s)
        seq_id, toks = self.seq_id(held, q), self.tokens(t)
        reply = self.call("Extend", self.stub.Extend, pb.ExtendRequest(
            session_id=self.sid_of(held), seq_id=seq_id, tokens=toks))
        if isinstance(reply, pb.ExtendReply) and isinstance(held, Held):
            before = held.seqs.get(seq_id)
            held.seqs[seq_id] = None if before is None else before + toks
            self.check_reply("Extend", held, reply.sequence)

    def op_Commit(self, s, q, dur):
        held = self.session(s)
        seq_id = self.seq_id(held, q)
        if isinstance(held, Held) and seq_id in held.seqs and held.seqs[seq_id] is None:
            return  # tokens unknown: the model could not say what a commit indexes
        reply = self.call("Commit", self.stub.Commit, pb.CommitRequest(
            session_id=self.sid_of(held), seq_id=seq_id, durability=dur))
        if isinstance(reply, pb.CommitReply) and isinstance(held, Held):
            self.check_reply("Commit", held, reply.sequence)
            added = self.committed(held, seq_id)
            if reply.indexed_blocks != added:
                raise BadStatus(f"Commit of sequence {seq_id} indexed {reply.indexed_blocks} "
                                f"blocks, the model {added}")

    def op_Fork(self, s, q, n):
        held = self.session(s)
        seq_id = self.seq_id(held, q)
        if isinstance(held, Held) and seq_id in held.seqs and held.seqs[seq_id] is None:
            return  # tokens unknown: a fork indexes the parent's full blocks, as a commit does
        reply = self.call("Fork", self.stub.Fork, pb.ForkRequest(
            session_id=self.sid_of(held), seq_id=seq_id, num_children=n))
        if isinstance(reply, pb.ForkReply) and isinstance(held, Held):
            self.committed(held, seq_id)  # PrefixCache.fork indexes the parent's full blocks
            for child in reply.children:
                held.seqs[child.seq_id] = held.seqs.get(seq_id)
                self.check_reply("Fork", held, child)

    def op_Release(self, s, q, commit, dur):
        held = self.session(s)
        seq_id = self.seq_id(held, q)
        if commit and isinstance(held, Held) and held.seqs.get(seq_id, b"") is None:
            commit = False
        reply = self.call("Release", self.stub.Release, pb.ReleaseRequest(
            session_id=self.sid_of(held), seq_id=seq_id, commit=commit, durability=dur))
        if isinstance(reply, pb.ReleaseReply) and isinstance(held, Held):
            if commit:
                self.committed(held, seq_id)
            held.seqs.pop(seq_id, None)
            self.released.append(seq_id)

    def op_WriteKV(self, s, chunks):
        held = self.session(s)
        lay = held.layout if isinstance(held, Held) else LAYOUT
        requests = []
        for other_session, (q, start, n, shp, dt, size, has_chunk) in chunks:
            right = [lay.num_layers, 2, n, lay.num_kv_heads, lay.head_dim]
            t = self.tensor((shp, dt, size), right, lay)
            kv = pb.KVChunk(seq_id=self.seq_id(held, q), start=start, num_tokens=n,
                            shape=t.shape, dtype=t.dtype, data=t.data)
            sid_ = self.sid_of(held) if not other_session else self.sid_of(self.session(("live", n)))
            requests.append(pb.WriteKVRequest(session_id=sid_, chunk=kv if has_chunk else None))
        self.call("WriteKV", self.stub.WriteKV, iter(requests))

    def op_ReadKV(self, s, q, start, n):
        held = self.session(s)
        self.call("ReadKV", lambda r: list(self.stub.ReadKV(r)), pb.ReadKVRequest(
            session_id=self.sid_of(held), seq_id=self.seq_id(held, q), start=start, num_tokens=n))

    def op_Attend(self, s, qs, layer, query, loc, kv, scale):
        held = self.session(s)
        lay = held.layout if isinstance(held, Held) else LAYOUT
        seq_ids = [self.seq_id(held, q) for q in qs]
        rows = len(seq_ids) if loc is None else (loc[-1] if loc else 0)
        request = pb.AttendRequest(session_id=self.sid_of(held), seq_ids=seq_ids, layer=layer,
                                   query_start_loc=loc or [], scale=scale)
        if query is not None:
            request.query.CopyFrom(self.tensor(query, [rows, lay.num_kv_heads * 2, lay.head_dim],
                                               lay))
        if kv is not None:
            right = [rows, lay.num_kv_heads, lay.head_dim]
            request.new_k.CopyFrom(self.tensor(kv[0], right, lay))
            request.new_v.CopyFrom(self.tensor(kv[1], right, lay))
        self.call("Attend", self.stub.Attend, request)

    def op_Stats(self, s):
        sid_ = 0 if s is None else self.sid_of(self.session(s))
        self.call("Stats", self.stub.Stats, pb.StatsRequest(session_id=sid_))

    def op_Status(self):
        self.call("Status", self.stub.Status, pb.StatusRequest())

    def op_Checkpoint(self):
        self.call("Checkpoint", self.stub.Checkpoint, pb.CheckpointRequest())

    def op_SubscribeEvents(self, s, start):
        # NOTE: the stream never ends by itself: take its first event (or its refusal), then
        # cancel it; the deadline only bounds a wait for the first event of an empty journal
        def first(request):
            call = self.stub.SubscribeEvents(request, timeout=2)
            try:
                return next(call, None)
            except grpc.RpcError as err:
                if err.code() != Code.DEADLINE_EXCEEDED:  # nothing yet: not a refusal
                    raise
                return None
            finally:
                call.cancel()

        self.call("SubscribeEvents", first,
                  pb.SubscribeEventsRequest(session_id=self.sid_of(self.session(s)),
                                            from_sequence_number=start))


def layout_key(msg: pb.KVLayout) -> str:
    return msg.SerializeToString(deterministic=True).hex()
