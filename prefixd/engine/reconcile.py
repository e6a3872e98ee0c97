"""Reconciliation: what a restart drops from the recovered tree, without the eviction queues.

At a RECOVER record in the log and at the end of the log: device residency is dropped (a GPU
pool dies with the process); host residency too unless the host pool survived (same boot);
runs resident nowhere are forgotten, children before parents, so that a run is forgotten only
once nothing below it needs it (``RadixTree.unplace``: the bookkeeping live operations use,
without the queues). Sequences move to their deepest surviving node. Eviction queues and
allocators are rebuilt by the caller afterwards (``RadixTree.rebuild_queues``). A tier whose
pool file was lost is dropped the same way (``forget_tier``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prefixd.cache.node import DEVICE, HOST, Node


def reconcile(tree, *, keep_host: bool, seqs: dict, forget: Callable[[Node], None] | None = None,
              order: list[Node] | None = None) -> int:
    """Drop what does not survive a restart; returns the number of runs forgotten.

    ``order``: every node that may hold what is dropped, parents before children (default:
    the whole tree). ``forget(node)`` is called for each run forgotten.
    """
    if order is None:
        order = list(tree.nodes())
    forgotten = 0
    tiers = (DEVICE,) if keep_host else (DEVICE, HOST)
    for node in reversed(order):
        slots = node.slots
        for tier in tiers:
            if slots[tier] is not None and tree.unplace(node, tier)[1]:
                forgotten += 1
                if forget is not None:
                    forget(node)
    for seq in seqs.values():
        seq[1] = surviving(seq[1])
    return forgotten


def forget_tier(tree, tier: int, seqs: dict) -> None:
    """Drop ``tier``'s residency from every run (its pool file is gone): runs resident nowhere
    else are forgotten, children first; sequences move to their deepest survivor."""
    for node in reversed(list(tree.nodes())):  # children before their parents
        if node.slots[tier] is not None:
            tree.unplace(node, tier)
    for seq in seqs.values():
        seq[1] = surviving(seq[1])


def shallow_first(nodes: Iterable[Node]) -> list[Node]:
    """The nodes of ``nodes`` still on the device, once each, parents before children (the
    ``order`` ``reconcile`` takes)."""
    depth_of: dict[int, tuple[int, Node]] = {}
    for node in nodes:
        if node.slots[DEVICE] is not None and id(node) not in depth_of:
            depth, n = 0, node
            while n.parent is not None:
                depth += 1
                n = n.parent
            depth_of[id(node)] = (depth, node)
    return [node for _, node in sorted(depth_of.values(), key=lambda dn: dn[0])]


def surviving(node: Node) -> Node:
    """The deepest node on ``node``'s path to the root that is still in the tree."""
    path = []
    n = node
    while n.parent is not None:
        path.append(n)
        n = n.parent
    best = n  # the root
    for n in reversed(path):
        if n.parent.children.get(n.key) is not n:
            break
        best = n
    return best
