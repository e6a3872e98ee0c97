"""Sequences that survived a restart, waiting for their client (DESIGN.md "Recovery").

Recovery cuts each live sequence back to its surviving blocks and holds a lock on its deepest
node (``RecoveredSeq``, in ``DurableCache.recovered``) for ``reclaim_grace_s``. A client that
comes back reclaims them: each is reopened through the normal open path (promotion included)
and the client learns the surviving length. Unclaimed ones are released when the grace ends;
their committed blocks stay cached. Both go through the cache's event path, so they are logged
like any other release.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prefixd.cache.node import path_to


class RecoveredSeq(NamedTuple):
    """A sequence that was live before the restart, cut back to its surviving blocks."""

    seq_id: int
    session_id: int
    node: object
    extra: bytes

    @property
    def num_tokens(self) -> int:
        """Tokens that survived (whole blocks on the path to ``node``)."""
        return sum(len(n.tokens) for n in path_to(self.node)) // 4


class Reclaimed(NamedTuple):
    """A reclaimed sequence: its old id, the new live sequence (``None`` if nothing survived)
    and how many tokens survived."""

    old_id: int
    seq: object
    num_tokens: int


def expire(cache, recovered: dict) -> int:
    """Release every sequence in ``recovered`` (emptied); their blocks stay cached. The caller
    logs the ``SeqReleased`` events this emits."""
    n = len(recovered)
    for rec in recovered.values():
        cache.release_recovered(rec.seq_id, rec.node)
    recovered.clear()
    return n


def reopen(cache, recovered: dict, session_id: int) -> Iterator[Reclaimed]:
    """Reopen the recovered sequences of ``session_id`` one at a time, yielding each after its
    OPEN and its old id's release are events (the caller logs them before the next one).

    Raises:
        OutOfBlocks: no device room to reopen one; it stays recovered (and locked) for a
            later reclaim or the expiry, and the ones yielded before it stay reopened.
    """
    for old_id in [k for k, r in recovered.items() if r.session_id == session_id]:
        rec = recovered[old_id]
        tokens = b"".join(n.tokens for n in path_to(rec.node))
        seq = cache.open(tokens, rec.extra, full_match=True) if tokens else None
        del recovered[old_id]
        cache.release_recovered(old_id, rec.node)  # a SeqReleased event, after the OPEN
        yield Reclaimed(old_id, seq, seq.cached_tokens if seq else 0)
