"""An eviction queue switched to another policy while it holds nodes (a live config reload)."""

from __future__ import annotations

import types

from prefixd.cache.policy import LFU, LRU, EvictionQueue


def _node(last_access: int, hit_count: int):
    return types.SimpleNamespace(last_access=last_access, hit_count=hit_count, priority=0,
                                 heap_tag=[0, 0, 0])


def test_set_policy_pops_in_the_new_order():
    """Keys under LRU are ints and under LFU tuples: without a re-key at the switch, ``pop``
    would compare the two (TypeError) or pop in the old order."""
    queue = EvictionQueue(0, LRU())
    nodes = [_node(1, 9), _node(2, 1), _node(3, 5), _node(4, 0)]
    for node in nodes:
        queue.add(node)
    queue.discard(nodes[0])  # a stale entry must stay dropped
    queue.set_policy(LFU())
    order = []
    while (node := queue.pop()) is not None:
        order.append(node.last_access)
    assert order == [4, 2, 3]
    queue.check_invariants()


def test_set_policy_then_touch_still_rekeys_lazily():
    queue = EvictionQueue(0, LFU())
    a, b = _node(1, 0), _node(2, 0)
    queue.add(a)
    queue.add(b)
    queue.set_policy(LRU())
    a.last_access = 10  # a hit after the switch: keys only grow within one policy
    assert queue.pop() is b and queue.pop() is a and queue.pop() is None
