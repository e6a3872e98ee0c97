"""Where a tier copy's parent hash and token ids come from, for the ZMQ KV events.

A copy into another tier (``BlocksMoved``: write-through, demotion, promotion) names its blocks
by hash only, and the radix tree keeps no index from a hash to its node. But every indexed block
entered the index by one run of one tenant publisher's events, a commit's ``BlocksStored`` or
a node of the recovered index at the start, and a radix node is always a slice of one such run
(nodes split, never merge). So the publisher keeps, per external hash, the run it came with
(``(hashes, parent, packed tokens, packed fields)``, one tuple shared by the run's blocks) until a
drop forgets the block (``BlocksDropped.forgotten``): a copy's parent is the block before it in
that run (or the run's parent) and its token ids the run's slice; a copy of the whole run reuses
the run's packed ``BlockStored`` fields (``kv_wire.stored_fields``).

Memory: one dict entry per indexed block (~100 bytes) plus the runs' packed tokens, which the
tree's nodes share until a split gives them their own.
"""

from __future__ import annotations

import numpy as np

from prefixd.daemon.kv_wire import stored_fields


class Lineage:
    """External hash -> ``(run hashes, run parent, run tokens, run fields)`` of every indexed
    block."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: dict[int, tuple[list[int], int | None, bytes, bytes]] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, hashes: list[int], parent: int | None, tokens: bytes, fields: bytes) -> None:
        self._runs.update(dict.fromkeys(hashes, (hashes, parent, tokens, fields)))

    def forget(self, hashes: list[int]) -> None:
        pop = self._runs.pop
        for h in hashes:
            pop(h, None)

    def fields(self, hashes: list[int], block_size: int) -> bytes | None:
        """The packed ``BlockStored`` fields (parent, token ids) of the run ``hashes`` (a slice
        of one known run), or None when it is not one."""
        rec = self._runs.get(hashes[0])
        if rec is None:
            return None
        run, parent, tokens, fields = rec
        if run is hashes or run == hashes:
            return fields
        i = run.index(hashes[0])
        n = len(hashes)
        if run[i:i + n] != hashes:
            return None
        bb = 4 * block_size
        ids = np.frombuffer(tokens, dtype="<i4", count=n * block_size, offset=i * bb).tolist()
        return stored_fields(hashes, run[i - 1] if i else parent, ids, block_size)
