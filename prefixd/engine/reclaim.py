"""Sequences that survived a restart, waiting for their client (DESIGN.md "Recovery").

Recovery cuts each live sequence back to its surviving blocks and holds a lock on its deepest
node (``RecoveredSeq``, in ``DurableCache.recovered``) for ``reclaim_grace_s``. A client that
comes back reclaims them: each is reopened under its own id through the normal open path
(promotion included), and the client learns the surviving length; its OPEN record, naming the
reclaiming session, supersedes the recovered sequence in the log. Unclaimed ones are released
when the grace ends; their committed blocks stay cached. Both go through the cache's event
path, so they are logged like any other open or release.
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
    """Reopen the recovered sequences of ``session_id`` one at a time, each under its own id,
    yielding each once its OPEN (or, when nothing survived, its release) is an event (the
    caller logs it before the next one).

    Raises:
        OutOfBlocks: no device room to reopen one; it stays recovered (and locked) for a
            later reclaim or the expiry, and the ones yielded before it stay reopened.
    """
    for old_id in [k for k, r in recovered.items() if r.session_id == session_id]:
        rec = recovered[old_id]
        if rec.node.parent is None:  # nothing survived
            del recovered[old_id]
            cache.release_recovered(old_id, rec.node)  # a SeqReleased event
            yield Reclaimed(old_id, None, 0)
            continue
        # NOTE: under its own id, so that a Reclaim cut by another restart after its records
        # were durable (the sequence is then recovered under the new session, which the
        # client never adopted) is reclaimed from that session by the id the client holds.
        seq = cache.reopen_recovered(old_id, rec.node, rec.extra)
        del recovered[old_id]
        yield Reclaimed(old_id, seq, seq.cached_tokens)
