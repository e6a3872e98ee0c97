"""The walk that pictures the index for a checkpoint, in slices across the event loop's turns.

A picture of a 1M-block index walks some ten thousand runs: 90-300 ms of Python in one go,
which held the daemon's loop that long. ``PictureWalk`` takes it in bounded slices (``step``)
while the engine serves between them, then ``finish`` makes it the state at that moment:

- the walk records each node it reaches (``record``: references to the node's tokens, hashes,
  checksums and slot lists, its numbers, its parent), keyed by the node;
- while the walk is open, the cache core marks every node it changes (``RadixTree.changed``,
  filled by ``RadixTree.mark``: a touch, a split, a residency placed or dropped, new checksums)
  and every node it adds or forgets;
- ``finish`` (on the engine's thread, after the log is settled) records each marked node again
  if it is still in the tree, and forgets it otherwise: O(marked nodes).

Every node of the tree at ``finish`` was reached by the walk (it hung below a node the walk
recorded after it was added, or it was there from the start and a split only re-hangs the
node it marks), or was added while the walk was open, and so marked; every recorded node whose
fields changed after it was recorded was marked. So the picture at ``finish`` is the tree at
``finish``, and the checkpoint's lsn is the log's last record then.

The records keep the parent as a node; ``Picture.values`` puts them in tree order off the loop.
"""

from __future__ import annotations

import time

from prefixd.cache.node import attached
from prefixd.engine.packed_node import PackedNode

SLICE_S = 0.002  # the most one ``step`` holds the engine's thread (checked every _CHECK nodes)
_CHECK = 64

# What the checkpoint stores of one node, by reference (see ``record``): a plain tuple
# ``(parent, num_blocks, last_access, hits, priority, tokens, hashes, on_device, host, disk,
# sums)``: ``parent`` the parent node (a root or a recorded node); ``hashes`` and ``sums``
# packed bytes (a ``PackedNode`` not unpacked) or the node's lists (``sums`` None without
# checksums); ``host`` / ``disk`` the slot lists or None.
PARENT, NUM_BLOCKS, LAST_ACCESS, HITS, PRIORITY, TOKENS, HASHES, ON_DEVICE, HOST, DISK, SUMS = range(11)


def record(node) -> tuple:
    """What the checkpoint stores of ``node`` now, by reference.

    NOTE: references stay right while the engine changes the tree: a node's tokens, hashes,
    checksums and per-tier slot lists are replaced, never changed in place (``cache.node``)."""
    on_device, on_host, on_disk = node.slots
    if type(node) is PackedNode:
        packed_hashes, packed_sums = node.still_packed()
        hashes = packed_hashes if packed_hashes is not None else node.hashes
        sums = packed_sums if packed_sums is not None else node.checksums
    else:
        hashes, sums = node.hashes, node.checksums
    return (node.parent, node.num_blocks, node.last_access, node.hit_count, node.priority,
            node.tokens, hashes, on_device is not None, on_host, on_disk, sums)


class PictureWalk:
    """One picture of ``tree`` in progress (see the module docstring).

    Fields: ``records`` (node -> ``record``, in the order reached), ``done`` (the walk reached
    every node it will; ``finish`` then makes the picture's records current).

    Invariants: while open, ``tree.changed`` is this walk's set of marked nodes; one walk per
    tree at a time. Not thread-safe: the engine's thread only.
    """

    def __init__(self, tree, marks: bool = True) -> None:
        """``marks=False``: a walk stepped to its end before the engine changes anything (no
        marks needed; it leaves another walk's marks be)."""
        self.tree = tree
        self.records: dict = {}
        self._marked: set = set()
        if marks:
            if tree.changed is not None:
                raise RuntimeError("a picture of this index is already being taken")
            tree.changed = self._marked
        # children reversed on the stack: nodes are reached in ``checkpoint.dump``'s order
        self._stack = [c for root in reversed(list(tree.roots.values()))
                       for c in reversed(list(root.children.values()))]
        self.done = not self._stack

    def step(self, budget_s: float = SLICE_S, most: int | None = None) -> bool:
        """Record nodes for at most about ``budget_s`` and at most ``most`` of them (None: no
        bound); returns ``done``."""
        stack, records = self._stack, self.records
        pop, extend = stack.pop, stack.extend
        deadline = time.perf_counter() + budget_s
        left = float("inf") if most is None else most
        while stack and left > 0:
            for _ in range(min(_CHECK, left)):
                if not stack:
                    break
                node = pop()
                records[node] = record(node)
                if node.children:
                    extend(reversed(node.children.values()))
                left -= 1
            if time.perf_counter() >= deadline:
                break
        self.done = not stack
        return self.done

    def finish(self) -> list:
        """Make the records the tree's now (the walk done: ``step`` until it says so) and
        close the walk; returns the roots as ``[(extra, root), ...]``."""
        if not self.done:
            raise RuntimeError("the picture's walk has nodes left: step it to the end first")
        records = self.records
        for node in self._marked:
            if attached(node):
                records[node] = record(node)
            else:
                records.pop(node, None)
        self.close()
        return list(self.tree.roots.items())

    def close(self) -> None:
        """Stop marking (the walk finished or was abandoned)."""
        if self.tree.changed is self._marked:
            self.tree.changed = None
