"""vLLM's KV-event wire format, written from the format (the daemon never imports vLLM).

A message on the PUB socket is three frames: the topic (UTF-8), the batch's sequence number
(8 bytes, big-endian) and the payload: one ``KVEventBatch`` in msgpack as msgspec encodes
vLLM's structs (``vllm/distributed/kv_events.py``):

- the batch is ``array_like``: ``[ts, events, data_parallel_rank]`` (``ts`` a float64 of
  seconds since the epoch; the rank nil: a daemon is no data-parallel rank);
- an event is a tagged struct, a map whose first key is ``"type"`` (the class name), then
  its fields in declaration order; fields with defaults are omitted (``omit_defaults``):
  ``BlockStored``: ``block_hashes``, ``parent_block_hash`` (nil for a sequence's first
  block), ``token_ids``, ``block_size``, ``lora_id`` (nil), ``medium``, ``lora_name`` (nil);
  ``BlockRemoved``: ``block_hashes``, ``medium``; ``AllBlocksCleared``: nothing.

Block hashes are vLLM's ``ExternalBlockHash`` as an unsigned 64-bit int: ``ExternalHashes``
turns prefixd's 128-bit chained hashes into them. ``medium`` names the tier (``MEDIUMS``):
``"GPU"`` and ``"CPU"`` as vLLM names them, ``"DISK"`` as Dynamo's router names its disk tier.

The replay socket (a ROUTER) answers a request ``[identity, b"", start_seq]`` with
``[identity, b"", topic, seq, payload]`` for each kept batch numbered ``>= start_seq``, then the
end marker ``[identity, b"", b"", END_SEQ, b""]``.
"""

from __future__ import annotations

import hashlib
import time

import msgpack
import numpy as np

# by prefixd's tier index (device, host, disk). NOTE: the disk tier is "DISK", not vLLM's
# MEDIUM_STORAGE: Dynamo's router reads "DISK" as its disk tier in every version, "STORAGE" only
# in recent ones (before, an unknown medium counts as the GPU's); docs/design.md has the evidence
MEDIUMS = ("GPU", "CPU", "DISK")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"

_pack = pack = msgpack.Packer(use_bin_type=True).pack  # ``pack``: a list of hashes, for one
_from_bytes = int.from_bytes


class ExternalHashes:
    """One tenant's 64-bit external block hashes: the first 8 bytes of prefixd's 128-bit
    chained hash (xxh3, so uniform), big-endian, XOR a key of the tenant's name.

    Equal prefixes of one tenant (and layout: its digest is in the chain's root) get equal
    hashes, across restarts too (the chain's root seed is persisted); the same hash in two
    tenants differs by the XOR of their keys, so two tenants' topics never share a hash even
    when their salts do.
    """

    __slots__ = ("key", "_key64")

    def __init__(self, tenant: str) -> None:
        digest = hashlib.blake2b(tenant.encode(), digest_size=8, person=b"prefixd-kv-evt").digest()
        self.key = _from_bytes(digest, "big")
        self._key64 = np.uint64(self.key)

    def one(self, h: bytes) -> int:
        return _from_bytes(h[:8], "big") ^ self.key

    def many(self, hashes) -> list[int]:
        """``one`` of each; NOTE: a long run goes through numpy (the 16-byte hashes joined, the
        first 8 bytes of each read big-endian): 2 us for 100 blocks, where a call per block
        costs ~30 us."""
        if len(hashes) > 12:
            first = np.frombuffer(b"".join(hashes), dtype=">u8")[::2]
            return (first ^ self._key64).tolist()
        key = self.key
        return [_from_bytes(h[:8], "big") ^ key for h in hashes]


def token_list(tokens: bytes) -> list[int]:
    """Packed little-endian int32 token ids as a list of ints."""
    return np.frombuffer(tokens, dtype="<i4").tolist()


# NOTE: events go out as msgpack bytes joined from fragments (the constant keys packed once),
# never as dicts packed whole: a batch costs the loop a third less, and a tier copy or a drop of
# a whole run reuses the run's packed fields or hashes (``kv_lineage``) as they are. A batch's
# events are a list of fragments (``stored`` / ``removed`` add theirs), joined once.
_STORED_HEAD = b"\x88" + _pack("type") + _pack(STORED) + _pack("block_hashes")
_PARENT_KEY, _TOKENS_KEY = _pack("parent_block_hash"), _pack("token_ids")
_BLOCK_SIZE_KEY = _pack("block_size")
_STORED_TAIL = {m: _pack("lora_id") + _pack(None) + _pack("medium") + _pack(m) + _pack("lora_name")
                + _pack(None) for m in MEDIUMS}
_REMOVED_HEAD = b"\x83" + _pack("type") + _pack(REMOVED) + _pack("block_hashes")
_REMOVED_TAIL = {m: _pack("medium") + _pack(m) for m in MEDIUMS}
_CLEARED = b"\x81" + _pack("type") + _pack(CLEARED)


def stored_fields(packed_hashes: bytes, parent: int | None, token_ids: list[int],
                  block_size: int) -> bytes:
    """The packed fields of a ``BlockStored`` that every medium shares (``stored`` adds the
    rest); ``packed_hashes``: the block hashes, ``pack``ed."""
    return b"".join((packed_hashes, _PARENT_KEY, _pack(parent), _TOKENS_KEY, _pack(token_ids),
                     _BLOCK_SIZE_KEY, _pack(block_size)))


class Batch:
    """The fragments of one ``KVEventBatch``'s events and how many events they make."""

    __slots__ = ("parts", "num_events")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.num_events = 0

    def stored(self, fields: bytes, medium: str) -> None:
        """A ``BlockStored`` of ``stored_fields`` (keys in vLLM's field order, the tag first)."""
        self.parts += (_STORED_HEAD, fields, _STORED_TAIL[medium])
        self.num_events += 1

    def removed(self, packed_hashes: bytes, medium: str) -> None:
        """A ``BlockRemoved`` of the ``pack``ed block hashes."""
        self.parts += (_REMOVED_HEAD, packed_hashes, _REMOVED_TAIL[medium])
        self.num_events += 1

    def cleared(self) -> None:
        """An ``AllBlocksCleared``."""
        self.parts.append(_CLEARED)
        self.num_events += 1

    def encode(self, ts: float | None = None) -> bytes:
        """The msgpack payload of this ``KVEventBatch``."""
        return b"".join((b"\x93", _pack(time.time() if ts is None else ts),
                         _header(self.num_events), *self.parts, b"\xc0"))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


_header = msgpack.Packer().pack_array_header
