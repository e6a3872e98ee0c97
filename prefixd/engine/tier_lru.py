"""One LRU across the pools of a tier: when a tier's byte budget is full, the least recently
used evictable blocks of that tier go first, whichever pool (tenant x layout) holds them.

Every pool of a tier is charged in one ``BudgetLedger`` (``prefixd.engine.budgets``), per 2 MiB
extent of its sparse files. A pool that needs ``n`` more blocks in a tier whose budget is full
asks ``TierLRU.make_room`` (its cache's ``on_tier_full``), which, until the ledger can take the
pool's charge, runs rounds of:

1. evict in one LRU order across pools: of the tier's pools whose blocks the ledger lets go for
   this tenant (its own always; another tenant's only above its ``reserved``; only its own when
   it is at its ``max``), the one whose coldest evictable run (radix node: blocks that share an
   access time) has the smallest eviction key evicts its runs colder than the runner-up pool's
   coldest, through its own eviction path (demoting as its policy does, so its log records and
   refcounts stay right: ``RoomPool.evict_coldest``), and again, until the round's bytes are
   evicted (the unit is the run, charged in bytes: a 4 MiB block pays 4 MiB);
2. settle: each other pool that evicted makes the drops durable and gives back the extents
   left idle (``RoomPool.settle``); bytes come back to the ledger extent by extent.

The asking pool's own evictions are not settled (it is mid-operation): their slots, in extents
it holds, are what its retry takes. A victim whose evictions gave no bytes back (its freed
slots sit in extents still in use) is spared for the rest of the call while the asking pool has
blocks of its own to recycle; a pool with none (or a pool being made) needs bytes, so rounds
then evict twice as much each time, until an extent empties. Over time a pool's blocks move to
its low extents (its allocator fills them first) and its high ones empty and are given back.

Eviction keys compare across pools because every pool's logical clock follows one
``SharedClock``. Nested calls (a demotion in a victim that needs room in a lower tier) do not
choose again: they return at once and that pool evicts its own blocks.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Protocol

from prefixd.api.tiers import TIER_NAMES
from prefixd.storage.budget_ledger import BudgetLedger

log = logging.getLogger(__name__)

MAX_ROUNDS = 8  # rounds per make_room: the last evicts up to 2**7 times the shortfall


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
        """The eviction key of the pool's coldest evictable run in ``tier``; None if none."""

    def evict_coldest(self, tier: int, limit, max_blocks: int) -> int:
        """Evict its coldest runs of ``tier`` while their key is at most ``limit`` (None: no
        limit; the first run goes whatever its key), up to ``max_blocks`` blocks (a run goes
        whole); returns the blocks evicted."""

    def settle(self, tier: int) -> int:
        """Make its evictions durable and give back its idle extents; returns the bytes."""

    def is_empty(self) -> bool:
        """Whether it holds no block in any tier."""

    def fixed(self, tier: int) -> bool:
        """Whether its ``tier`` is allocated whole (a GPU pool): evicting there gives no bytes
        back, and it never asks for any."""


class PoolRoom:
    """A durable pool as ``TierLRU`` sees it (``RoomPool``)."""

    __slots__ = ("tenant", "block_bytes", "dc")

    def __init__(self, tenant: str, dc) -> None:
        self.tenant, self.dc = tenant, dc
        self.block_bytes = dc.layout.block_bytes

    def coldest_key(self, tier: int):
        cache = self.dc.cache
        if cache.allocators[tier] is None or self.fixed(tier):
            return None
        queue = cache.tree.queues[tier]
        node = queue.peek()
        return None if node is None else queue.policy.key(node)

    def evict_coldest(self, tier: int, limit, max_blocks: int) -> int:
        cache = self.dc.cache
        queue = cache.tree.queues[tier]
        key = queue.policy.key
        runs, freed = [], 0
        while freed < max_blocks:
            node = queue.peek()
            if node is None or (runs and limit is not None and key(node) > limit):
                break
            n = cache.evict(1, tier)
            if not n:
                break
            runs.append(node)
            freed += n
        return freed

    def settle(self, tier: int) -> int:
        return self.dc.settle_room(tier)

    def is_empty(self) -> bool:
        """No indexed block in any tier (a pool the engine may close: ``pool_close``)."""
        return not any(self.dc.cache.tree.num_blocks_in)

    def fixed(self, tier: int) -> bool:
        return self.dc.cache.allocators[tier] is not None and self.dc.store.is_fixed(tier)


class TierLRU:
    """The choice of victims across the pools of each tier.

    Args:
        ledgers: the tier's ledger by tier name (``Budgets.ledgers``).
        pools: returns every open pool as ``(key, RoomPool)`` (the engine's pools, now).

    Counters: ``rounds[tier]`` evictions asked, ``cross_pool[tier]`` settles of another pool
    than the asking one, ``bytes_freed[tier]`` bytes they gave back. ``emptied``: keys of the
    pools a settle left with no block (the engine may close them: ``pool_close``).
    """

    def __init__(self, ledgers: dict[str, BudgetLedger],
                 pools: Callable[[], Iterable[tuple[object, RoomPool]]]) -> None:
        self.ledgers = ledgers
        self.pools = pools
        self._busy = False
        self.rounds = [0, 0, 0]
        self.cross_pool = [0, 0, 0]
        self.bytes_freed = [0, 0, 0]
        self.emptied: set = set()

    def make_room(self, key, tier: int, num_blocks: int, others_only: bool = False) -> bool:
        """Make the ledger of ``tier`` able to take ``num_blocks`` more blocks of pool ``key``
        (see the module docstring). Returns whether the charge fits now (or the asking pool
        evicted its own blocks, whose slots it reuses). ``others_only``: never the asking
        pool's blocks (it counted what it could evict itself already)."""
        pools = dict(self.pools())
        me = pools.get(key)
        if me is None or me.fixed(tier):  # a whole pool has what it has: its own slots
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
        ledger = self.ledgers[TIER_NAMES[tier]]
        self._busy = True
        try:
            target, own = need, 0
            me = pools.get(key)  # None: a pool not made yet (or one that gives nothing itself)
            for _ in range(MAX_ROUNDS):
                short = ledger.shortfall(tenant, need)
                if short.total_bytes <= 0:
                    return True
                goal = max(short.total_bytes, target)
                evicted, touched = 0, []
                while evicted < goal:
                    pick = self.victim(pools, tenant, tier, short.own_bytes > 0)
                    if pick is None:
                        break
                    victim_key, limit = pick
                    pool = pools[victim_key]
                    n = -(-(goal - evicted) // pool.block_bytes)
                    while pool.tenant != tenant and n > 1 and not ledger.may_evict(
                            pool.tenant, n * pool.block_bytes, tenant):
                        n //= 2  # what is left above its reservation
                    n = pool.evict_coldest(tier, limit, n)
                    if not n:
                        break
                    self.rounds[tier] += 1
                    evicted += n * pool.block_bytes
                    if victim_key == key:
                        own += n
                    elif victim_key not in touched:
                        touched.append(victim_key)
                if own >= num_blocks > 0:
                    return True  # its own slots, in extents it holds, are enough
                recycles = me is not None and me.coldest_key(tier) is not None
                for victim_key in touched:
                    self.cross_pool[tier] += 1
                    freed = pools[victim_key].settle(tier)
                    self.bytes_freed[tier] += freed
                    if pools[victim_key].is_empty():
                        self.emptied.add(victim_key)
                    if not freed and recycles:  # spared from here on: see the module docstring
                        pools = {k: v for k, v in pools.items() if k != victim_key}
                if not evicted:
                    break
                target *= 2
            return own > 0 or ledger.can_charge(tenant, need)
        finally:
            self._busy = False

    def victim(self, pools: dict, tenant: str, tier: int, own_only: bool):
        """``(key, limit)``: the pool whose coldest evictable run of ``tier`` goes first for
        ``tenant`` (its own pools only when ``own_only``: it is at its max; else every pool
        whose tenant the ledger lets give a block up), and the coldest key of the runner-up
        (None: no other); None when no pool has a run to give."""
        ledger = self.ledgers[TIER_NAMES[tier]]
        best = second = None  # (eviction key, pool key)
        for pool_key, pool in pools.items():
            if pool.tenant != tenant and (own_only or not ledger.may_evict(
                    pool.tenant, pool.block_bytes, tenant)):
                continue
            cold = pool.coldest_key(tier)
            if cold is None:
                continue
            if best is None or cold < best[0]:
                best, second = (cold, pool_key), best
            elif second is None or cold < second[0]:
                second = (cold, pool_key)
        if best is None:
            return None
        return best[1], None if second is None else second[0]

    def counters(self) -> dict:
        return {"rounds": list(self.rounds), "cross_pool": list(self.cross_pool),
                "bytes_freed": list(self.bytes_freed)}
