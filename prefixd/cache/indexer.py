"""Indexing a sequence's full blocks: the commit step of the cache core.

``Indexer`` is the part of ``prefixd.cache.prefix_cache.PrefixCache`` that inserts the blocks a
sequence filled since its last commit into the radix tree, moves its lock to the deepest node,
appends the events (``BlocksMoved`` for runs that took its device copies, ``BlocksStored``,
``SeqCommitted``) and starts the write-through of a new run. It holds the cache's tree, its
event list (the one list: ``drain_events`` empties it in place), its stats and its tiering.
"""

from __future__ import annotations

from prefixd.cache.events import BlocksMoved, BlocksStored, SeqCommitted, new_event
from prefixd.cache.node import DEVICE, Node
from prefixd.cache.sequence import Sequence


class Indexer:
    """Indexes committed blocks of one cache's sequences (see the module docstring)."""

    def __init__(self, tree, block_bytes: int, events: list, stats, tiering) -> None:
        self.tree = tree
        self.block_bytes = block_bytes  # token bytes per block
        self.events = events
        self.stats = stats
        self.tiering = tiering  # None: one tier and write-through (nothing to write down)

    def index(self, seq: Sequence) -> int:
        """Index ``seq``'s full blocks past its indexed prefix; returns how many blocks entered
        the index. Where the index holds some of them already, ``seq``'s table switches to the
        index's slots and its own go to ``seq.dup_slots``."""
        bb = self.block_bytes
        num_full = len(seq.tokens) // bb
        first = seq.num_indexed
        if num_full <= first:
            return 0
        table = seq.block_table
        ours = table[first:num_full]
        node = seq.node
        new_tokens = bytes(memoryview(seq.tokens)[first * bb:num_full * bb])
        adopted: list[Node] = []
        deepest, tree_slots, new = self.tree.insert(node, new_tokens, ours, adopted)
        if tree_slots is not ours:
            for i, (mine, theirs) in enumerate(zip(ours, tree_slots)):
                if mine != theirs:
                    seq.dup_slots.append(mine)
                    table[first + i] = theirs
        if node.lock_ref > 1:  # insert locked ``deepest``, always a descendant of ``node``
            node.lock_ref -= 1
        else:
            self.tree.unlock(node)
        seq.node = deepest
        seq.num_indexed = num_full
        events = self.events  # the one list: the write-through may drain it (``drain_events``)
        for run in adopted:  # runs only in lower tiers took our device copies of their blocks
            events.append(new_event(BlocksMoved, (DEVICE, run.hashes, run.slots[DEVICE], [])))
        added = 0
        if new is not None:
            events.append(new_event(BlocksStored, (new.parent.hashes[-1], new.hashes, new.tokens, new.slots[DEVICE])))
            added = new.num_blocks
            self.stats.committed_blocks += added
            if self.tiering is not None:
                self.tiering.write_through(new)
        events.append(new_event(SeqCommitted, (seq.id, num_full, deepest.hashes[-1])))
        return added
