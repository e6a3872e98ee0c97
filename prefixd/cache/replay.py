"""Replay: apply logged records to a tree loaded from the checkpoint, then reconcile.

Records name blocks by hash; ``Replayer`` keeps a hash -> node map and cuts a run where a
record names a block inside it (every live split was caused by a logged operation, so replay
reproduces it). Sequences are tracked as ``[session_id, deepest node, extra]``: their private
blocks never survive, so EXTEND and COW records carry nothing replay needs.

Reconciliation (at a RECOVER record, and at the end of the log): device residency is dropped;
host residency too unless the host pool survived (same boot); runs resident nowhere are
forgotten. Eviction queues and allocators are rebuilt by the caller afterwards.
"""

from __future__ import annotations

from prefixd.cache.hashing import namespace_hash
from prefixd.cache.node import DEVICE, HOST, Node, split
from prefixd.cache.records import decode_move, decode_put, split_hashes
from prefixd.wal.records import Kind

ZERO_HASH = b"\x00" * 16


class ReplayError(Exception):
    """A record does not fit the state replay reached: the log and checkpoint disagree."""


class Replayer:
    """Applies records to ``tree`` (already holding the checkpoint).

    Fields:
        where: block hash -> node holding it (roots under their namespace hash).
        seqs: seq_id -> ``[session_id, node, extra]`` for sequences not yet released.
    """

    def __init__(self, tree, seqs: dict, block_bytes: int) -> None:
        self.tree = tree
        self.block_bytes = block_bytes
        self.seqs = seqs
        self.where: dict[bytes, Node] | None = None
        self.records = 0

    # -- the hash map ------------------------------------------------------------------------

    def _build_map(self) -> None:
        where = {}
        for root in self.tree.roots.values():
            where[root.hashes[-1]] = root
        for node in self.tree.nodes():
            where.update(dict.fromkeys(node.hashes, node))
        self.where = where

    def _node_of(self, h: bytes) -> Node:
        if self.where is None:
            self._build_map()
        try:
            return self.where[h]
        except KeyError:
            raise ReplayError(f"record names block {h.hex()} that is not in the index") from None

    def ending_at(self, h: bytes) -> Node:
        """The node whose last block is ``h`` (splitting the run holding it if needed)."""
        node = self._node_of(h)
        if node.parent is None:
            return node
        i = node.hashes.index(h)
        if i < node.num_blocks - 1:
            head = split(node, i + 1, self.block_bytes)
            self.where.update(dict.fromkeys(head.hashes, head))
            return head
        return node

    def run(self, hashes: list[bytes]) -> Node:
        """The node holding exactly the run ``hashes`` (cut at both ends as needed)."""
        first = self._node_of(hashes[0])
        i = first.hashes.index(hashes[0])
        if i:
            head = split(first, i, self.block_bytes)
            self.where.update(dict.fromkeys(head.hashes, head))
        node = self.ending_at(hashes[-1])
        if node.hashes[0] != hashes[0]:
            raise ReplayError(f"run {hashes[0].hex()}.. spans more than one node")
        return node

    # -- records -----------------------------------------------------------------------------

    def apply(self, rec) -> None:
        kind, f, blob = rec.kind, rec.fields, rec.blob
        self.records += 1
        tree = self.tree
        if kind == Kind.BLOCK_PUT:
            parent_hash, hashes, tokens, slots = decode_put(blob, f[1], self.block_bytes)
            parent = self.ending_at(parent_hash)
            bb = self.block_bytes
            if tokens[:bb] in parent.children:
                raise ReplayError(f"BLOCK_PUT lsn {rec.lsn}: the run is already indexed")
            node = Node(parent, tokens[:bb], tokens, len(hashes), hashes, [None, None, None], tree.clock)
            parent.children[node.key] = node
            tree.set_residency(node, DEVICE, slots)
            self.where.update(dict.fromkeys(hashes, node))
        elif kind == Kind.BLOCK_MOVE:
            hashes, slots, sums = decode_move(blob, f[1])
            node = self.run(hashes)
            tier = f[0]
            if node.slots[tier] is not None:
                raise ReplayError(f"BLOCK_MOVE lsn {rec.lsn}: run already resident in tier {tier}")
            tree.set_residency(node, tier, slots)
            if sums is not None:
                node.checksums = sums
        elif kind == Kind.BLOCK_DROP:
            node = self.run(split_hashes(blob, f[1]))
            if node.slots[f[0]] is None:
                raise ReplayError(f"BLOCK_DROP lsn {rec.lsn}: run not resident in tier {f[0]}")
            self._drop(node, f[0])
        elif kind == Kind.OPEN:
            seq_id, session_id = f[0], f[1]
            deepest, extra = blob[:16], blob[16:]
            if extra not in tree.roots:
                root = tree.root(extra)
                if self.where is not None:
                    self.where[root.hashes[-1]] = root
            node = tree.roots[extra] if deepest == ZERO_HASH else self.ending_at(deepest)
            tree.clock += 1
            n = node
            while n.parent is not None:
                n.last_access = tree.clock
                n.hit_count += 1
                n = n.parent
            self.seqs[seq_id] = [session_id, node, extra]
        elif kind == Kind.COMMIT:
            seq = self.seqs.get(f[0])
            if seq is not None:
                tree.clock += 1
                seq[1] = self.ending_at(blob)
                seq[1].last_access = tree.clock
        elif kind == Kind.FORK:
            parent = self.seqs.get(f[0])
            if parent is not None:
                for child in range(f[1], f[1] + f[2]):
                    self.seqs[child] = list(parent)
        elif kind == Kind.RELEASE:
            self.seqs.pop(f[0], None)
        elif kind == Kind.RECOVER:
            reconcile(tree, keep_host=bool(f[1]), seqs=self.seqs, replayer=self)
        # ATTACH, DETACH, EXTEND, COW, TOUCH: nothing that outlives a restart

    def _drop(self, node: Node, tier: int) -> None:
        _, forgotten = self.tree.drop_residency(node, tier)
        if forgotten:
            self.forget(node)

    def forget(self, node: Node) -> None:
        node.checksums = None
        if self.where is not None:
            for h in node.hashes:
                if self.where.get(h) is node:
                    del self.where[h]


def reconcile(tree, *, keep_host: bool, seqs: dict, replayer: Replayer | None = None) -> int:
    """Drop what does not survive a restart; returns the number of runs forgotten.

    Children before parents, so that a run is forgotten only once nothing below it needs it.
    """
    order = list(tree.nodes())
    forgotten = 0
    for node in reversed(order):
        for tier in (DEVICE, HOST):
            if tier == HOST and keep_host:
                continue
            if node.slots[tier] is not None:
                _, gone = tree.drop_residency(node, tier)
                if gone:
                    forgotten += 1
                    if replayer is not None:
                        replayer.forget(node)
    for seq in seqs.values():
        seq[1] = surviving(seq[1])
    return forgotten


def attached(node: Node) -> bool:
    while node.parent is not None:
        if node.parent.children.get(node.key) is not node:
            return False
        node = node.parent
    return True


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


def root_for(tree, extra: bytes):
    return tree.roots.get(extra) or tree.root(extra)


__all__ = ["Replayer", "ReplayError", "reconcile", "surviving", "attached", "namespace_hash"]
