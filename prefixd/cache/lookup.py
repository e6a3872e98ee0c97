"""Lookup: how much of a prompt the cache holds, by tier, without pinning or touching anything."""

from __future__ import annotations

from typing import NamedTuple

from prefixd.api.tiers import DISK


class LookupResult(NamedTuple):
    """Cached tokens of a prompt, and how many of them each tier would serve (best tier).

    Fields:
        cached_tokens: tokens an ``open`` will serve (given device room): the match up to the
            first run whose only copy is an unverified disk copy.
        device_tokens, host_tokens, disk_tokens: the whole match by the best tier holding each
            token (they sum to ``cached_tokens + unverified_tokens``).
        unverified_tokens: the rest of the match: disk blocks found by a recovery whose
            checksums no one has checked since (``Node.disk_verified``). An ``open`` checks
            them and serves them unless they turned out corrupt; a caller must not count them
            as a sure hit.
    """

    cached_tokens: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    unverified_tokens: int = 0


def lookup(tree, tokens: bytes, extra: bytes = b"") -> LookupResult:
    """The match of packed ``tokens`` in ``tree`` under namespace ``extra``, by best tier.

    NOTE: after a restart (lazy verify) a disk block's checksum is checked only when an
    ``open`` promotes it, and a corrupt one is cut there; so tokens from the first
    unverified disk run on are reported as ``unverified_tokens``, not ``cached_tokens``.
    Checking them here would read every disk block a lookup touches; a lookup stays an
    index walk.
    """
    pairs = tree.peek(tree.root(extra), tokens, len(tokens) // tree.block_bytes)
    by_tier = [0, 0, 0]
    bs = tree.block_size
    unverified = 0
    for node, k in pairs:
        best = next(t for t in range(3) if node.slots[t] is not None)
        by_tier[best] += k * bs
        if unverified or (best == DISK and not node.disk_verified):
            unverified += k * bs
    return LookupResult(sum(by_tier) - unverified, *by_tier, unverified)
