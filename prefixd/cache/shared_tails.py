"""Partial last blocks shared by forked siblings, and how many siblings share each.

A fork indexes the parent's full blocks first, so the only block siblings share privately is a
partial last one; the first sibling to ``extend`` into it copies it (copy-on-write) and drops
its share. ``PrefixCache`` keeps one ``SharedTails``.

Invariant: every count is >= 2 (a slot held by one sequence alone is not listed).

NOTE: a ``dict`` subclass, not a wrapper: ``extend`` asks ``tails and slot in tails`` on every
decode step, and those stay C calls.
"""

from __future__ import annotations


class SharedTails(dict):
    """Device slot -> how many sequences share it as their partial last block."""

    def share(self, slot: int, more: int) -> None:
        """``more`` new sequences share ``slot`` (one already holds it)."""
        self[slot] = self.get(slot, 1) + more

    def drop(self, slot: int) -> None:
        """One sequence stops sharing ``slot`` (it copied it, or was released)."""
        count = self[slot] - 1
        if count > 1:
            self[slot] = count
        else:
            del self[slot]
