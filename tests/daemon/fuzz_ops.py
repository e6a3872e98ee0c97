"""The fuzzer of ``test_fuzz.py``: hypothesis strategies for one call of every rpc, and the
``Fuzzer`` that resolves them against what it knows of the daemon and makes the calls.

An op is plain data drawn by hypothesis (which rpc, which kind of session / sequence id, which
kind of tokens, shapes, dtypes, numbers); the ``Fuzzer`` turns it into a request at run time,
because the live ids exist only then: a "live" session id is one the fuzzer attached, a
"stale" one was detached, expired or is from before a restart, "other" belongs to the other
tenant. Valid calls happen too (they are what reaches the deep checks), and the fuzzer keeps
a model of what they did: the tokens of every sequence it holds, and every full block a
successful Commit / Release(commit) indexed (as a set of block-aligned token prefixes, per
layout) so the test can check that refused calls changed nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import grpc
import numpy as np
from hypothesis import strategies as st

from prefixd.api import prefixd_pb2 as pb

Code = grpc.StatusCode
ALLOWED = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED,
           Code.FAILED_PRECONDITION, Code.UNAVAILABLE, Code.OUT_OF_RANGE, Code.UNIMPLEMENTED}

BS = 4
LAYOUT = pb.KVLayout(model_id="fuzz", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float32", block_size=BS)
# valid layouts of other pools (bounded: each makes a pool)
ALT_LAYOUTS = [pb.KVLayout(model_id="fuzz", num_layers=2, num_kv_heads=2, head_dim=8,
                           dtype="float16", block_size=BS),
               pb.KVLayout(model_id="fuzz-b", num_layers=1, num_kv_heads=1, head_dim=4,
                           dtype="bfloat16", block_size=8)]
# two more, so that with POOLS_PER_TENANT pools made before the warm-up every further valid
# layout drawn is refused by the pool limit (and the fds and RSS measure leaks, not new pools)
FILLER_LAYOUTS = [pb.KVLayout(model_id=f"filler-{i}", num_layers=1, num_kv_heads=1, head_dim=2,
                              dtype="float16", block_size=2) for i in range(2)]
POOLS_PER_TENANT = 1 + len(ALT_LAYOUTS) + len(FILLER_LAYOUTS)
# valid as a KVLayout, far too big as a pool: must be refused without harm
HUGE_LAYOUTS = [pb.KVLayout(model_id="huge", num_layers=65536, num_kv_heads=65536,
                            head_dim=65536, dtype="float32", block_size=65536),
                pb.KVLayout(model_id="big", num_layers=64, num_kv_heads=64, head_dim=256,
                            dtype="float32", block_size=1024)]
BASE = [np.arange(10_000 * (i + 1), 10_000 * (i + 1) + 96, dtype="<i4") for i in range(6)]
MAX_MESSAGE = 1 << 20
U64 = (1 << 64) - 1
MAX_LIVE_SESSIONS = 6
MAX_SEQS = 12  # per live session, so the device pool does not fill with held blocks

# -- drawing ops ----------------------------------------------------------------------------------
#
# One description of what to draw, two sources of choices: hypothesis (``HypothesisDraw`` over
# ``st.data()``: structured, shrinks a failure to a short list of calls) and a seeded
# ``random.Random`` (``RandomDraw``: ~100x cheaper a call on this host, so the bulk of the calls).

class RandomDraw:
    """Choices from a seeded ``random.Random``."""

    CHARS = "aZ09 _-./\x00\u00e9\u4e2d\U0001f600\ufffd"

    def __init__(self, rng) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, items):
        return self.rng.choice(items)

    def bool(self) -> bool:
        return self.rng.random() < 0.5

    def bytes(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))

    def text(self, hi: int) -> str:
        return "".join(self.rng.choice(self.CHARS) for _ in range(self.rng.randint(0, hi)))


class HypothesisDraw:
    """Choices drawn by hypothesis (``data`` is what ``st.data()`` gives a test)."""

    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, items):
        return self.data.draw(st.sampled_from(items))

    def bool(self) -> bool:
        return self.data.draw(st.booleans())

    def bytes(self, lo: int, hi: int) -> bytes:
        return self.data.draw(st.binary(min_size=lo, max_size=hi))

    def text(self, hi: int) -> str:
        return self.data.draw(st.text(max_size=hi))


SID_KINDS = ["live"] * 8 + ["stale", "zero", "max", "random", "other"]
SEQ_KINDS = ["own"] * 8 + ["released", "zero", "max", "random", "foreign"]
DURABILITIES = ["", "crash", "index", "power"]
DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", ""]
U32_EDGES = [2**31 - 1, 2**31, 2**32 - 1]


def u64(d) -> int:
    return d.choice([0, 1, U64, 2**63]) if d.int(0, 3) == 0 else d.int(0, U64)


def sid(d) -> tuple:
    return d.choice(SID_KINDS), u64(d)


def seq(d) -> tuple:
    return d.choice(SEQ_KINDS), u64(d)


def small_u32(d) -> int:
    return d.int(0, 130) if d.int(0, 5) else d.choice(U32_EDGES)


def tokens(d) -> tuple:
    k = d.int(0, 13)
    if k < 8:
        return ("base", d.int(0, len(BASE) - 1), d.int(0, 96),
                [d.int(0, 1) for _ in range(d.int(0, 6))])
    if k == 8:
        return ("empty",)
    if k == 9:
        raw = d.bytes(1, 23)
        return ("ragged", raw if len(raw) % 4 else raw + b"\x01")
    if k == 10:
        raw = d.bytes(4, 64)
        return ("random", raw[:len(raw) // 4 * 4])
    if k == 11:
        return ("extremes",)
    # an oversized message costs the client ~0.2 s to be refused: 1 in 16 of the big ones
    return ("oversize",) if d.int(0, 15) == 0 else ("large", d.int(4_200, 9_000))


def durability(d) -> str:
    return d.choice(DURABILITIES) if d.bool() else d.text(10)


def dtype(d) -> str:
    return d.choice(DTYPES) if d.int(0, 3) else d.text(8)


def shape(d):
    return "right" if d.bool() else [small_u32(d) for _ in range(d.int(0, 6))]


def data_len(d):
    return "right" if d.bool() else d.int(0, 4096)


def layout_field(d) -> int:
    # a random layout that is valid makes a pool: small fields keep its files small (and the
    # pool limit refuses it anyway once the pools are made); the big values are invalid
    return d.int(0, 4) if d.int(0, 4) else d.choice([65537, 2**32 - 1])


def layout(d):
    k = d.int(0, 5)
    if k <= 1:
        return "main"
    if k == 2:
        return d.int(0, len(ALT_LAYOUTS) - 1)
    if k == 3:
        return ("huge", d.int(0, len(HUGE_LAYOUTS) - 1))
    if k == 4:
        return pb.KVLayout(model_id=d.text(300), num_layers=layout_field(d),
                           num_kv_heads=layout_field(d), head_dim=layout_field(d), dtype=dtype(d),
                           block_size=layout_field(d))
    return None


def tensor(d) -> tuple:
    return shape(d), dtype(d), data_len(d)


def maybe(d, draw):
    return draw(d) if d.bool() else None


OPS = {
    "Attach": lambda d: (layout(d), d.text(200)),
    "Detach": lambda d: (sid(d),),
    "KeepAlive": lambda d: (sid(d), [sid(d) for _ in range(d.int(0, 2))]),
    "Reclaim": lambda d: (sid(d), ("previous", u64(d)) if d.bool() else sid(d)),
    "Lookup": lambda d: (sid(d), tokens(d)),
    "Open": lambda d: (sid(d), tokens(d)),
    "Extend": lambda d: (sid(d), seq(d), tokens(d)),
    "Commit": lambda d: (sid(d), seq(d), durability(d)),
    "Fork": lambda d: (sid(d), seq(d), d.int(0, 3) if d.int(0, 3) else
                       d.choice([1024, 1025, 2**32 - 1])),
    "Release": lambda d: (sid(d), seq(d), d.bool(), durability(d)),
    "WriteKV": lambda d: (sid(d), [(d.int(0, 7) == 0, (seq(d), small_u32(d), small_u32(d),
                                                       shape(d), dtype(d), data_len(d),
                                                       d.int(0, 7) > 0))
                                   for _ in range(d.int(0, 3))]),
    "ReadKV": lambda d: (sid(d), seq(d), small_u32(d), small_u32(d)),
    "Attend": lambda d: (sid(d), [seq(d) for _ in range(d.int(0, 3))], small_u32(d),
                         maybe(d, tensor), maybe(d, lambda d: [small_u32(d)
                                                               for _ in range(d.int(0, 4))]),
                         maybe(d, lambda d: (tensor(d), tensor(d))),
                         d.choice([0.0, 0.5, -1.0, float("nan"), float("inf")])),
    "Stats": lambda d: (maybe(d, sid),),
    "Status": lambda d: (),
    "Checkpoint": lambda d: (),
    "SubscribeEvents": lambda d: (sid(d), u64(d)),
}
# the common rpcs more often than the admin ones
WEIGHTS = {"Checkpoint": 1, "Status": 2, "Stats": 2, "SubscribeEvents": 1, "Attach": 4,
           "Detach": 2, "KeepAlive": 2, "Reclaim": 2}
WEIGHTED = [name for name in OPS for _ in range(WEIGHTS.get(name, 6))]


def op(d) -> tuple[str, tuple]:
    """One drawn call: ``(rpc name, its drawn fields)`` for ``Fuzzer.run``."""
    name = d.choice(WEIGHTED)
    return name, OPS[name](d)


# -- the fuzzer ----------------------------------------------------------------------------------

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
        self.call("SubscribeEvents", lambda r: list(self.stub.SubscribeEvents(r)),
                  pb.SubscribeEventsRequest(session_id=self.sid_of(self.session(s)),
                                            from_sequence_number=start))


def layout_key(msg: pb.KVLayout) -> str:
    return msg.SerializeToString(deterministic=True).hex()
