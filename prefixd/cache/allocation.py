"""Room in a tier: slots from its allocator, evicting as needed, and the check that comes first.

``Allocation.allocate`` is the cache's one allocate-evict-retry: requests (open, extend),
promotion into the device and demotion into a lower tier all take slots through it.
``can_allocate`` says beforehand whether the device can make room for a request, so that
``open`` and ``extend`` refuse with ``OutOfBlocks`` before they evict anything (STYLE: pair the
check with the mutation).
"""

from __future__ import annotations

import time

from prefixd.cache.errors import OutOfBlocks
from prefixd.cache.events import BlocksDropped, new_event
from prefixd.cache.node import DEVICE


class Allocation:
    """Slots for one ``PrefixCache``: allocate, evict, retry; and what eviction could free.

    What the device can give a request is its free slots plus every device block that no lock
    pins (``RadixTree.pinned_device_blocks``): eviction takes unlocked leaves and, as they go,
    their parents, so it can free exactly the device blocks outside the locked paths. Device
    eviction never fails once a victim is popped (a demotion that finds no room below drops
    the copy anyway), so a request that ``can_allocate`` approves gets its slots.

    An ``open`` of ``total`` blocks whose match has ``D`` blocks on the device needs
    ``total - D`` slots (promotion included) and pins those ``D`` blocks: it peeks at its match
    (``RadixTree.peek``: no split, no touch), checks with the match as ``path`` only when
    ``total - D`` exceeds the free slots (else nothing is evicted), and only then takes it.

    NOTE: the check walks the locked paths (one step per pinned node; none when nothing is
    locked), and only when a request needs more than the free slots: cheaper than keeping a
    pinned count exact through every lock, split and residency change on the hot path.

    Args:
        cache: the owner: its tree, allocators, tiering, stats, events,
            ``on_deferred_shortage`` (the engine's hook for slots quarantined until the log
            is durable) and ``on_tier_full`` (the engine's hook that makes room in a tier's
            byte budget across pools).
    """

    def __init__(self, cache) -> None:
        self.cache = cache
        self.tree = cache.tree
        self.allocators = cache.allocators
        self.device = cache.allocators[DEVICE]

    def allocate(self, tier: int, n: int) -> list[int] | None:
        """``n`` slots of ``tier``, evicting there as needed; ``None`` when they cannot be had.

        When a lower tier is short only of slots quarantined until the log is durable, the
        engine's ``on_deferred_shortage`` is asked (once) to make them reusable.

        NOTE: what was evicted on the way stays evicted when this fails; a caller that must
        change nothing on failure asks ``can_allocate`` first (``open``, ``extend``).
        """
        slots = self.allocators[tier].allocate(n)
        return slots if slots is not None else self.allocate_evicting(tier, n)

    def allocate_evicting(self, tier: int, n: int) -> list[int] | None:
        """``allocate`` for a caller that already found the free slots of ``tier`` short of
        ``n`` (``open``, ``extend``): evict, retry, and ask the engine once for quarantined
        slots; ``None`` when they cannot be had."""
        alloc = self.allocators[tier]
        short = n - alloc.num_free
        on_tier_full = self.cache.on_tier_full
        if on_tier_full is not None:  # the engine: one LRU across the pools of the tier
            fits = on_tier_full(tier, n)
            slots = alloc.allocate(n)
            if slots is not None:
                return slots
            # the budget has no bytes for it: its own blocks' slots (in extents it holds) must
            # make the room; else only its free slots were short
            short = n - alloc.num_free if fits else max(short, n)
        self.evict(tier, short)
        slots = alloc.allocate(n)
        if slots is None and alloc.num_deferred and self.cache.on_deferred_shortage is not None:
            self.cache.on_deferred_shortage()
            slots = alloc.allocate(n)
        return slots

    def available(self, path=()) -> int:
        """Device slots a request could get: free ones plus every device block no lock pins.
        ``path``: the ``(node, blocks)`` pairs of a match the request will lock (``peek``'s)."""
        tree = self.tree
        return self.device.num_free + tree.num_blocks_in[DEVICE] - tree.pinned_device_blocks(path)

    def can_allocate(self, n: int, path=()) -> bool:
        """Whether ``n`` device slots can be had, evicting as needed, with ``path`` locked too.
        Changes nothing."""
        return n <= self.device.num_free or n <= self.available(path)

    def ensure_room(self, n: int, path=()) -> None:
        """Like ``can_allocate``, for a request: raises instead of answering ``False``. Short
        of room in this pool, the engine's ``on_tier_full`` first evicts other pools' coldest
        blocks of the device tier's budget (nothing of this pool changes either way).

        Raises:
            OutOfBlocks: naming the need and what could be had; nothing was changed.
        """
        free = self.device.num_free
        if n > free:
            tree = self.tree  # ``available(path)``, with the free count at hand
            available = free + tree.num_blocks_in[DEVICE] - tree.pinned_device_blocks(path)
            if n > available and self.cache.on_tier_full is not None:
                # the tier's budget may be held by other pools: their coldest blocks go, never
                # this pool's (what it could evict is counted already)
                self.cache.on_tier_full(DEVICE, n - available, others_only=True)
                free = self.device.num_free
                available = free + tree.num_blocks_in[DEVICE] - tree.pinned_device_blocks(path)
            if n > available:
                raise OutOfBlocks(n, available)

    def evict(self, tier: int, num_blocks: int) -> int:
        """Evict at least ``num_blocks`` unlocked blocks of ``tier`` if there are that many
        (whole runs, so possibly more); returns how many were freed. Device evictions are
        counted in the cache's stats."""
        cache = self.cache
        if tier != DEVICE:
            if self.allocators[tier] is None:
                raise ValueError(f"tier {tier} is not present")
            return cache.tiering.evict(tier, num_blocks)
        start = time.perf_counter_ns()
        if cache.tiering is not None:
            freed = cache.tiering.evict(DEVICE, num_blocks)
        else:  # one tier: a victim is forgotten, nothing to demote
            tree, freed = self.tree, 0
            pop, drop = tree.queues[DEVICE].pop, tree.drop_residency
            free, append = self.device.free, cache.events.append
            while freed < num_blocks:
                node = pop()
                if node is None:
                    break
                slots, forgotten = drop(node, DEVICE)
                free(slots)
                freed += len(slots)
                append(new_event(BlocksDropped, (DEVICE, node.hashes, slots, forgotten)))
            cache.stats.evicted_by_tier[DEVICE] += freed
        stats = cache.stats
        stats.evicted_blocks += freed
        stats.evict_ns += time.perf_counter_ns() - start
        return freed
