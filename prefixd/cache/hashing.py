"""Block identity: 128-bit hashes chained on the parent, from a persisted root.

``block_hash = xxh3_128(parent_hash || token_ids)``; the first block's parent is the namespace
root ``xxh3_128(root_seed || tenant_salt || layout_digest || extra)``. The root seed is created
once per state directory and persisted, so identities are stable across restarts (never
``hash()`` or a per-process random).

NOTE: the hash is the block's durable name (the WAL and the checkpoint speak of hashes); the
radix tree matches token ids directly, so a hit never hashes and a hash collision can never serve
another prompt's KV.
"""

from __future__ import annotations

import struct

import xxhash

HASH_BYTES = 16
_h128 = xxhash.xxh3_128_digest
_splitters: dict[tuple[int, int], object] = {}  # (bytes, block bytes) -> Struct(...).unpack


def root_hash(root_seed: bytes, tenant_salt: bytes = b"", layout_digest: bytes = b"") -> bytes:
    """The root of one tenant's namespace for one layout."""
    parts = (root_seed, tenant_salt, layout_digest)
    return _h128(b"prefixd-root\x00" + b"\x00".join(len(p).to_bytes(4, "little") + p for p in parts))


def namespace_hash(root: bytes, extra: bytes) -> bytes:
    """The parent hash of a sequence's first block; ``extra`` (LoRA id, images) splits it."""
    return _h128(root + b"extra\x00" + extra) if extra else root


def chain_hashes(parent_hash: bytes, tokens: bytes, block_bytes: int, _h=_h128) -> list[bytes]:
    """Hashes of consecutive full blocks of packed tokens, chained from ``parent_hash``.

    NOTE: the blocks are cut by one ``struct`` unpack (cached per length) rather than a slice
    per block: a commit hashes ~23 blocks, and a slice each is a third of the hashing's
    instructions. Same bytes in, same hashes out.
    """
    h = parent_hash
    n = len(tokens)
    split = _splitters.get((n, block_bytes))
    if split is None:
        if n % block_bytes or not n:
            return [h := _h(h + tokens[s:s + block_bytes]) for s in range(0, n, block_bytes)]
        if len(_splitters) >= 256:
            _splitters.clear()
        split = _splitters[(n, block_bytes)] = struct.Struct(f"{block_bytes}s" * (n // block_bytes)).unpack
    return [h := _h(h + block) for block in split(tokens)]
