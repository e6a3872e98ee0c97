"""Eviction order: a pluggable key, and a per-tier queue of evictable nodes.

A policy is one method, ``key(node)``: the queue pops the smallest key first. Keys may only grow
while a node waits in the queue (a hit raises ``last_access`` and ``hit_count``); the queue
re-keys lazily when it pops a node whose key has changed, so a touch costs nothing on the hot
path.
"""

from __future__ import annotations

import heapq
import itertools


class LRU:
    """Least recently used first."""

    name = "lru"

    @staticmethod
    def key(node):
        return node.last_access


class LFU:
    """Fewest hits first; ties broken by least recent use."""

    name = "lfu"

    @staticmethod
    def key(node):
        return (node.hit_count, node.last_access)


class Priority:
    """Lowest user priority first, then least recent use (SGLang-style priority retention)."""

    name = "priority"

    @staticmethod
    def key(node):
        return (node.priority, node.last_access)


POLICIES = {cls.name: cls for cls in (LRU, LFU, Priority)}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


class EvictionQueue:
    """Evictable nodes of one tier, smallest policy key first.

    A heap of ``(key, tag, node)`` with lazy deletion: a node's live entry is the one whose tag
    equals ``node.heap_tag[tier]``; removing a node only zeroes its tag. Stale entries are
    dropped when popped, and the heap is rebuilt when they outnumber live ones.

    Invariant: ``num_live`` equals the number of nodes with a nonzero ``heap_tag[tier]``.
    """

    __slots__ = ("tier", "policy", "_heap", "_tags", "num_live")

    def __init__(self, tier: int, policy) -> None:
        self.tier = tier
        self.policy = policy
        self._heap: list = []
        self._tags = itertools.count(1)
        self.num_live = 0

    def add(self, node) -> None:
        if node.heap_tag[self.tier]:
            return
        tag = next(self._tags)
        node.heap_tag[self.tier] = tag
        heapq.heappush(self._heap, (self.policy.key(node), tag, node))
        self.num_live += 1

    def discard(self, node) -> None:
        if node.heap_tag[self.tier]:
            node.heap_tag[self.tier] = 0
            self.num_live -= 1
            if len(self._heap) > 4 * self.num_live + 1024:
                self._compact()

    def pop(self):
        """The node to evict next, removed from the queue; ``None`` when empty."""
        heap, tier, key_of = self._heap, self.tier, self.policy.key
        while heap:
            key, tag, node = heapq.heappop(heap)
            if node.heap_tag[tier] != tag:
                continue
            current = key_of(node)
            if current != key:
                heapq.heappush(heap, (current, tag, node))
                continue
            node.heap_tag[tier] = 0
            self.num_live -= 1
            return node
        return None

    def peek(self):
        """The node ``pop`` would return, left in the queue; ``None`` when empty. Stale
        entries met on the way are dropped and changed keys re-keyed, as ``pop`` does."""
        heap, tier, key_of = self._heap, self.tier, self.policy.key
        while heap:
            key, tag, node = heap[0]
            if node.heap_tag[tier] != tag:
                heapq.heappop(heap)
                continue
            current = key_of(node)
            if current != key:
                heapq.heapreplace(heap, (current, tag, node))
                continue
            return node
        return None

    def set_policy(self, policy) -> None:
        """Order the queue by ``policy`` from now on (a live config change): every live entry
        is re-keyed and the heap rebuilt, O(n); stale entries are dropped on the way.

        NOTE: the lazy re-key in ``pop`` assumes keys only grow under one policy; across a
        policy change they need not, so every entry gets its new key here, at once.
        """
        tier = self.tier
        self.policy = policy
        self._heap = [(policy.key(node), tag, node) for _, tag, node in self._heap
                      if node.heap_tag[tier] == tag]
        heapq.heapify(self._heap)

    def live_nodes(self) -> list:
        tier = self.tier
        return [node for _, tag, node in self._heap if node.heap_tag[tier] == tag]

    def _compact(self) -> None:
        tier = self.tier
        self._heap = [e for e in self._heap if e[2].heap_tag[tier] == e[1]]
        heapq.heapify(self._heap)

    def check_invariants(self) -> None:
        live = self.live_nodes()
        assert len(live) == self.num_live, "eviction queue live count drifted"
        assert len({id(n) for n in live}) == len(live), "a node is live twice in a queue"
