"""The cluster tier's key and value format: one immutable block per key, checked on every read.

Key: ``prefixd:<namespace digest, 32 hex>:<block hash, 32 hex>``. Value, little-endian::

    magic   4  b"PXRB"
    version 1  1
    flags   1  0
    pad     2  0
    tokens  4  byte length of the token ids (block_size x int32)
    kv      4  byte length of the KV bytes
    hash    16 the block's chained hash (the same as in the key)
    parent  16 the parent block's chained hash
    token ids, then KV bytes
    sum     8  xxh3-64 of everything above

A reader trusts nothing: the checksum must hold, the stored hash must be the key's, the parent
must be the previous block of the run, and the token ids must be the ones asked for.

NOTE: no hash tag in the key, so the blocks of one prefix spread over every slot and every
master: a hot system prompt loads the whole cluster, not one node, and a fetch reads from all
masters at once. The price is availability: with one master down (and no replica), a run is cut
at its first block on that master. Replicas (docs/scale-out.md) answer that, not locality. Hex,
not raw bytes, in the key: a raw hash could contain ``{...}`` and become a hash tag by accident.

NOTE: the block hash is in the value too, so a value copied or written under the wrong key is
detected; the namespace is in the key only (the hash chain already mixes in the tenant salt and
layout, so two namespaces cannot produce each other's hashes short of a 128-bit collision).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"PXRB"
VERSION = 1
HASH_BYTES = 16
_HEAD = struct.Struct("<4sBBHII")
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + 2 * HASH_BYTES
OVERHEAD_BYTES = HEADER_BYTES + _SUM.size
KEY_PREFIX = b"prefixd:"


@dataclass(frozen=True)
class ClusterBlock:
    """One block as the cluster holds it.

    Attributes:
        block_hash: 16-byte chained hash (the fleet-wide chain the engine computes).
        parent_hash: 16 bytes, the previous block's ``block_hash``.
        token_ids: packed little-endian int32, block_size tokens.
        kv: the block's KV bytes in the pool's layout, all layers. ``get_run`` returns a
            read-only ``memoryview`` into the value it read (bytes-like: ``len``, ``==``,
            ``np.frombuffer`` and ``b"".join`` take it as they take bytes).

    NOTE: a memoryview, not a bytes slice, on the read path: slicing 360 KiB out of each value
    was a third of ``get_run``'s time on a 2k-token prefix (a copy into fresh pages), and the
    engine copies the bytes into its pool anyway.
    """

    block_hash: bytes
    parent_hash: bytes
    token_ids: bytes
    kv: bytes | memoryview


class Verdict(enum.Enum):
    """What a read found under a key."""

    OK = "ok"
    CORRUPT = "corrupt"    # format, checksum, stored hash or parent chain wrong
    MISMATCH = "mismatch"  # intact, but other token ids than asked (a collision or a bug upstream)


def namespace_digest(namespace: bytes) -> bytes:
    """16 bytes naming the pool's namespace in every key (xxh3-128 of the namespace bytes)."""
    return xxhash.xxh3_128_digest(namespace)


def key_of(ns_hex: bytes, block_hash: bytes) -> bytes:
    return KEY_PREFIX + ns_hex + b":" + block_hash.hex().encode()


def check_block(block: ClusterBlock) -> None:
    """Raises ValueError for a block the caller built wrong (hash lengths, token bytes)."""
    if len(block.block_hash) != HASH_BYTES or len(block.parent_hash) != HASH_BYTES:
        raise ValueError(f"block_hash and parent_hash must be {HASH_BYTES} bytes, got "
                         f"{len(block.block_hash)} and {len(block.parent_hash)}")
    if len(block.token_ids) % 4:
        raise ValueError(f"token_ids must be packed int32, got {len(block.token_ids)} bytes")


def encode(block: ClusterBlock) -> bytes:
    """The value stored for ``block`` (one copy of the KV bytes)."""
    head = _HEAD.pack(MAGIC, VERSION, 0, 0, len(block.token_ids), len(block.kv))
    h = xxhash.xxh3_64()
    for part in (head, block.block_hash, block.parent_hash, block.token_ids, block.kv):
        h.update(part)
    return b"".join((head, block.block_hash, block.parent_hash, block.token_ids, block.kv,
                     _SUM.pack(h.intdigest())))


def decode(value: bytes, block_hash: bytes, parent_hash: bytes | None,
           token_ids: bytes) -> tuple[Verdict, ClusterBlock | None]:
    """Check ``value`` against what was asked; the block only when every check holds.

    Args:
        value: the bytes read from the key of ``block_hash``.
        parent_hash: the previous block of the run, or None for the first block asked.
        token_ids: the token ids the caller expects in this block.
    """
    if len(value) < OVERHEAD_BYTES:
        return Verdict.CORRUPT, None
    magic, version, _, _, n_tokens, n_kv = _HEAD.unpack_from(value, 0)
    if magic != MAGIC or version != VERSION or OVERHEAD_BYTES + n_tokens + n_kv != len(value):
        return Verdict.CORRUPT, None
    body = memoryview(value)[:-_SUM.size]
    if xxhash.xxh3_64_intdigest(body) != _SUM.unpack_from(value, len(value) - _SUM.size)[0]:
        return Verdict.CORRUPT, None
    at = _HEAD.size
    stored_hash, stored_parent = value[at:at + HASH_BYTES], value[at + HASH_BYTES:HEADER_BYTES]
    if stored_hash != block_hash or (parent_hash is not None and stored_parent != parent_hash):
        return Verdict.CORRUPT, None
    tokens_end = HEADER_BYTES + n_tokens
    if body[HEADER_BYTES:tokens_end] != token_ids:
        return Verdict.MISMATCH, None
    return Verdict.OK, ClusterBlock(stored_hash, stored_parent, value[HEADER_BYTES:tokens_end],
                                   body[tokens_end:tokens_end + n_kv])
