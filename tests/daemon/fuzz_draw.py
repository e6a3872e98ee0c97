"""What the fuzzer of ``test_fuzz.py`` draws: one call of any rpc, as plain data (which rpc,
which kind of session / sequence id, which kind of tokens, shapes, dtypes, numbers). The
``Fuzzer`` (``fuzz_ops``) turns it into a request at run time, when the live ids exist.

One description, two sources of choices: hypothesis (``HypothesisDraw`` over ``st.data()``:
structured, shrinks a failure to a short list of calls) and a seeded ``random.Random``
(``RandomDraw``: drawing through hypothesis cost ~10 ms a call on the loaded 2-core host, more
than the call itself, so the bulk of the calls come from here).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from prefixd.api import prefixd_pb2 as pb

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

# -- sources of choices ---------------------------------------------------------------------------

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


# -- what is drawn --------------------------------------------------------------------------------

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
