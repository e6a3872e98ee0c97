"""What the ZMQ KV events say of a block after its commit: parent, token ids, external hashes.

A copy into another tier (``BlocksMoved``: write-through, demotion, promotion) and a drop
(``BlocksDropped``) name their blocks by prefixd's hash only, and the radix tree keeps no index
from a hash to its node. But every indexed block entered the index by one run of one tenant
publisher's events, a commit's ``BlocksStored`` or a node of the recovered index at the start,
and a radix node is always a slice of one such run (nodes split, never merge). So the publisher
keeps, per prefixd block hash, the ``Run`` it came with (one record shared by the run's blocks)
until a drop forgets the block (``BlocksDropped.forgotten``): a copy's parent is the block before
it in that run (or the run's parent) and its token ids the run's slice.

NOTE (the loop's cost): a run is converted and packed once, at its store: a copy or a drop of the
whole run (the common case: write-through copies the committed run, eviction takes a leaf's run)
reuses the run's packed ``BlockStored`` fields or packed external hashes as they are, with no
hash converted and nothing packed again; only a slice of a run is packed anew.

Memory: one dict entry per indexed block (its key is the tree's own hash object) plus one
``Run`` per run, whose packed tokens the tree's nodes share until a split gives them their own.
"""

from __future__ import annotations

import numpy as np

from prefixd.daemon.kv_wire import ExternalHashes, pack, stored_fields, token_list


class Run:
    """One run as it was indexed: ``hashes`` (prefixd's), ``ext`` (their external hashes),
    ``packed`` (``ext`` packed), ``parent`` (external, None under a namespace root), ``tokens``
    (packed int32) and ``fields`` (its packed ``BlockStored`` fields)."""

    __slots__ = ("hashes", "ext", "packed", "parent", "tokens", "fields")

    def __init__(self, hashes, ext, packed, parent, tokens, fields) -> None:
        self.hashes, self.ext, self.packed = hashes, ext, packed
        self.parent, self.tokens, self.fields = parent, tokens, fields


class Lineage:
    """Prefixd block hash -> the ``Run`` it was indexed with, for one tenant publisher
    (``ext``: that tenant's ``ExternalHashes``)."""

    __slots__ = ("_runs", "ext")

    def __init__(self, ext: ExternalHashes) -> None:
        self._runs: dict[bytes, Run] = {}
        self.ext = ext

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, hashes: list[bytes], parent: int | None, tokens: bytes,
            block_size: int) -> Run:
        """Index the run ``hashes`` (its tokens packed, its parent's external hash) and return it
        with its fields packed."""
        ext = self.ext.many(hashes)
        packed = pack(ext)
        run = Run(hashes, ext, packed, parent, tokens,
                  stored_fields(packed, parent, token_list(tokens), block_size))
        self._runs.update(dict.fromkeys(hashes, run))
        return run

    def forget(self, hashes: list[bytes]) -> None:
        pop = self._runs.pop
        for h in hashes:
            pop(h, None)

    def fields(self, hashes: list[bytes], block_size: int) -> bytes:
        """The packed ``BlockStored`` fields of ``hashes``: parent and token ids when they are a
        slice of one known run, else the external hashes alone (as vLLM's offloading connector's
        placeholder stores: no parent, no token ids)."""
        run = self._runs.get(hashes[0])
        if run is not None:
            ids = run.hashes
            if ids is hashes or ids == hashes:
                return run.fields
            i = ids.index(hashes[0])
            n = len(hashes)
            if ids[i:i + n] == hashes:
                bb = 4 * block_size
                tokens = np.frombuffer(run.tokens, dtype="<i4", count=n * block_size,
                                       offset=i * bb).tolist()
                return stored_fields(pack(run.ext[i:i + n]), run.ext[i - 1] if i else run.parent,
                                     tokens, block_size)
        return stored_fields(pack(self.ext.many(hashes)), None, [], block_size)

    def packed(self, hashes: list[bytes]) -> bytes:
        """The external hashes of ``hashes``, packed (a whole known run's as they were)."""
        run = self._runs.get(hashes[0])
        if run is not None and (run.hashes is hashes or run.hashes == hashes):
            return run.packed
        return pack(self.ext.many(hashes))
