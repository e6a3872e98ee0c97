"""The gsp-like workload that the daemon's load, lease and crash clients send: its layout, the
shared system prompts, the KV of a prompt, and the raw-stub calls that write and read that KV.

KV is a function of each token's whole prefix (``kv_of``), as a model's would be: two clients
that share a prefix write identical bytes for it, so a committed block has one right value,
and a checker compares digests (``digest``) of what comes back with what was written.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

from prefixd.api import prefixd_pb2 as pb

BS = 16
L, H, D = 2, 2, 4
LAYOUT = dict(model_id="gsp-load", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
              block_size=BS)
SYSTEM_LENGTHS = (40, 48, 64, 80)  # shared prefixes (not all block-aligned)


def pb_layout() -> pb.KVLayout:
    return pb.KVLayout(**LAYOUT)


def systems() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(50000) for _ in range(n)] for n in SYSTEM_LENGTHS]


def packed(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def kv_of(tokens, start: int, n: int) -> np.ndarray:
    """KV ``[L, 2, n, H, D]`` of tokens ``start .. start + n``: each token's values come from a
    rolling hash of its whole prefix (exact in float32: all values are integers below 2**23)."""
    h, out = 0, []
    for t in tokens[:start + n]:
        h = (h * 1000003 + int(t) + 1) % 65521
        out.append(h)
    hs = np.asarray(out[start:], dtype=np.float32).reshape(1, 1, n, 1, 1)
    layer = np.arange(L, dtype=np.float32).reshape(L, 1, 1, 1, 1)
    kv = np.arange(2, dtype=np.float32).reshape(1, 2, 1, 1, 1)
    lane = np.arange(H * D, dtype=np.float32).reshape(1, 1, 1, H, D)
    return (hs * 64 + layer * 32 + kv * 16 + lane).astype(np.float32)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def write_kv(stub, session: int, seq_id: int, tokens, start: int) -> None:
    n = len(tokens) - start
    if n <= 0:
        return
    chunk = pb.KVChunk(seq_id=seq_id, start=start, num_tokens=n, shape=[L, 2, n, H, D],
                       dtype="float32", data=kv_of(tokens, start, n).tobytes())
    stub.WriteKV(iter([pb.WriteKVRequest(session_id=session, chunk=chunk)]), timeout=30)


def read_kv(stub, session: int, seq_id: int, n: int) -> bytes:
    req = pb.ReadKVRequest(session_id=session, seq_id=seq_id, start=0, num_tokens=n)
    return b"".join(r.chunk.data for r in stub.ReadKV(req, timeout=30))
