"""One LRU across the pools of a tier: when a tier's byte budget is full, the least recently
used evictable blocks of that tier go first, whichever pool (tenant x layout) holds them.

Every pool of a tier is charged in one ``BudgetLedger`` (``prefixd.engine.budgets``). A pool
that needs ``n`` more blocks in a tier whose budget is full asks ``TierLRU.make_room`` (its
cache's ``on_tier_full``), which, until the ledger can take the pool's charge:

1. picks the victim pool: among the tier's pools whose blocks the ledger lets go for this
   tenant (its own always; another tenant's only above its ``reserved``; only its own when it
   is at its ``max``), the one whose coldest evictable block has the smallest eviction key;
2. has it give room (``RoomPool.give_room``): the victim evicts (demotes, as its policy does)
   its coldest blocks through its own eviction path, so its log records and refcounts stay
   right, makes those drops durable, and gives back the extents left idle; the bytes come
   back to the ledger extent by extent;
3. when the coldest pool is the asking one, it evicts its own blocks and stops: their slots
   sit in extents it holds, so its retry takes them without a new charge.

The unit is a batch: the victim gives ``max(shortfall, BATCH_BYTES)`` bytes' worth of its own
blocks, then the choice is made again. One block at a time would make each step pay a log
fsync in the victim; a batch bounds that to one per ``BATCH_BYTES``, and is fine grain
against budgets of hundreds of MiB. Eviction keys compare across pools because every pool's
logical clock follows one ``SharedClock``.

Nested calls (an eviction in the victim that needs room in a lower tier) do not pick victims
again: they return at once and that pool falls back to its own eviction.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Protocol

from prefixd.api.tiers import TIER_NAMES
from prefixd.storage.budget_ledger import BudgetLedger

log = logging.getLogger(__name__)

BATCH_BYTES = 4 << 20  # two 2 MiB extents: see the module docstring
MAX_ROUNDS = 64  # victims asked per make_room at most (each frees a batch or stops the loop)


class SharedClock:
    """The logical clock every pool's eviction keys follow: a pool's tree clock is raised to
    ``now`` before each of its operations, and ``now`` to the tree's after, so a block touched
    later has a larger key whichever pool it is in."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0

    def enter(self, tree) -> None:
        if tree.clock < self.now:
            tree.clock = self.now

    def leave(self, tree) -> None:
        if tree.clock > self.now:
            self.now = tree.clock


class RoomPool(Protocol):
    """What ``TierLRU`` needs of a pool."""

    tenant: str
    block_bytes: int

    def coldest_key(self, tier: int):
        """The eviction key of the pool's coldest evictable block in ``tier``; None if none."""

    def give_room(self, tier: int, num_blocks: int, own: bool) -> int:
        """Evict at least ``num_blocks`` of its coldest blocks of ``tier``; returns the bytes
        given back to the ledger (``own``: the asking pool, mid-operation: evict only)."""


class PoolRoom:
    """A durable pool as ``TierLRU`` sees it (``RoomPool``)."""

    __slots__ = ("tenant", "block_bytes", "dc")

    def __init__(self, tenant: str, dc) -> None:
        self.tenant, self.dc = tenant, dc
        self.block_bytes = dc.layout.block_bytes

    def coldest_key(self, tier: int):
        cache = self.dc.cache
        if cache.allocators[tier] is None:
            return None
        queue = cache.tree.queues[tier]
        node = queue.peek()
        return None if node is None else queue.policy.key(node)

    def give_room(self, tier: int, num_blocks: int, own: bool) -> int:
        if own:  # mid-operation: its own log step records the drops
            self.dc.cache.evict(num_blocks, tier)
            return 0
        return self.dc.give_room(tier, num_blocks)


class TierLRU:
    """The choice of victims across the pools of each tier.

    Args:
        ledgers: the tier's ledger by tier name (``Budgets.ledgers``).
        pools: returns every open pool as ``(key, RoomPool)`` (the engine's pools, now).

    Counters: ``rounds[tier]`` victims asked, ``cross_pool[tier]`` of them another pool than
    the asking one, ``bytes_freed[tier]`` bytes given back by other pools.
    """

    def __init__(self, ledgers: dict[str, BudgetLedger],
                 pools: Callable[[], Iterable[tuple[object, RoomPool]]]) -> None:
        self.ledgers = ledgers
        self.pools = pools
        self._busy = False
        self.rounds = [0, 0, 0]
        self.cross_pool = [0, 0, 0]
        self.bytes_freed = [0, 0, 0]

    def make_room(self, key, tier: int, num_blocks: int, others_only: bool = False) -> bool:
        """Make the ledger of ``tier`` able to take ``num_blocks`` more blocks of pool ``key``
        (see the module docstring). Returns whether the charge fits now (or the asking pool
        evicted its own blocks, whose slots it reuses). ``others_only``: never the asking
        pool's blocks (it counted what it could evict itself already)."""
        pools = dict(self.pools())
        me = pools.get(key)
        if me is None:
            return False
        if others_only:
            del pools[key]
        return self._make_room(pools, key, me.tenant, tier, num_blocks * me.block_bytes, num_blocks)

    def make_room_bytes(self, tenant: str, tier: int, nbytes: int) -> bool:
        """Make the ledger of ``tier`` able to take ``nbytes`` more for ``tenant``, for a pool
        not made yet (its files' first extents); returns whether it fits now."""
        return self._make_room(dict(self.pools()), None, tenant, tier, nbytes, 0)

    def _make_room(self, pools: dict, key, tenant: str, tier: int, need: int, num_blocks: int) -> bool:
        if self._busy:
            return False
        me = pools.get(key)  # None: a pool not made yet, or one that gives nothing itself
        ledger = self.ledgers[TIER_NAMES[tier]]
        self._busy = True
        try:
            for _ in range(MAX_ROUNDS):
                short = ledger.shortfall(tenant, need)
                if short.total_bytes <= 0:
                    return True
                victim_key = self.victim(pools, tenant, tier, short.own_bytes > 0)
                if victim_key is None:
                    return False
                self.rounds[tier] += 1
                if victim_key == key:
                    me.give_room(tier, num_blocks, True)
                    return True
                victim = pools[victim_key]
                want = max(short.total_bytes, BATCH_BYTES)
                if victim.tenant != tenant and not ledger.may_evict(victim.tenant, want, tenant):
                    want = victim.block_bytes  # what is left above its reservation: a block at a time
                freed = victim.give_room(tier, -(-want // victim.block_bytes), False)
                self.cross_pool[tier] += 1
                self.bytes_freed[tier] += freed
            return ledger.can_charge(tenant, need)
        finally:
            self._busy = False

    def victim(self, pools: dict, tenant: str, tier: int, own_only: bool):
        """The key of the pool whose coldest evictable block of ``tier`` goes first for
        ``tenant``: its own pools only when ``own_only`` (it is at its max), else every pool
        whose tenant the ledger lets give a block up; None when none has one."""
        ledger = self.ledgers[TIER_NAMES[tier]]
        best, best_key = None, None
        for pool_key, pool in pools.items():
            if pool.tenant != tenant and (own_only or not ledger.may_evict(
                    pool.tenant, pool.block_bytes, tenant)):
                continue
            cold = pool.coldest_key(tier)
            if cold is not None and (best_key is None or cold < best_key):
                best, best_key = pool_key, cold
        return best

    def counters(self) -> dict:
        return {"rounds": list(self.rounds), "cross_pool": list(self.cross_pool),
                "bytes_freed": list(self.bytes_freed)}
