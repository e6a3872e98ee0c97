"""Replay: apply logged records to a tree loaded from the checkpoint, then reconcile.

Records name blocks by hash; ``Replayer`` keeps a hash -> node map and cuts a run where a
record names a block inside it (every live split was caused by a logged operation, so replay
reproduces it). Sequences are tracked as ``[session_id, deepest node, extra]``: their private
blocks never survive, so EXTEND and COW records carry nothing replay needs.

Reconciliation (at a RECOVER record, and at the end of the log): device residency is dropped;
host residency too unless the host pool survived (same boot); runs resident nowhere are
forgotten. Eviction queues and allocators are rebuilt by the caller afterwards.

NOTE: replay runs once per record of a log tail (100k records name millions of blocks), so it
touches blocks only where a record brings new per-block data (BLOCK_PUT, BLOCK_MOVE): a run is
found from its first and last hash, never by splitting the whole hash list; residency changes
skip the eviction queues (``rebuild_queues`` replaces them after recovery); the hash map is
built on first use. After a checkpoint it holds only the first and last hash of each
checkpoint run (a 1M-block map cost a quarter of a second to build): a record naming a block
inside such a run, which is rare (a match ending inside a run), finds it in the checkpoint's
flat hash column instead.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from itertools import chain, repeat

from prefixd.cache.hashing import namespace_hash
from prefixd.cache.node import DEVICE, HOST, Node, split
from prefixd.wal.records import Kind

ZERO_HASH = b"\x00" * 16
H = 16

_PUT, _MOVE, _DROP = int(Kind.BLOCK_PUT), int(Kind.BLOCK_MOVE), int(Kind.BLOCK_DROP)
_OPEN, _COMMIT, _FORK = int(Kind.OPEN), int(Kind.COMMIT), int(Kind.FORK)
_RELEASE, _RECOVER = int(Kind.RELEASE), int(Kind.RECOVER)

_structs: dict[tuple[str, int], struct.Struct] = {}


def _unpacker(code: str, n: int):
    """``unpack_from`` of ``n`` little-endian items of ``code`` (cached per count)."""
    s = _structs.get((code, n))
    if s is None:
        s = _structs[(code, n)] = struct.Struct("<" + code * n if code == "16s" else f"<{n}{code}")
    return s.unpack_from


class ReplayError(Exception):
    """A record does not fit the state replay reached: the log and checkpoint disagree."""


def set_residency(tree, node: Node, tier: int, slots: list[int]) -> None:
    """``RadixTree.set_residency`` without the eviction queues (rebuilt after recovery)."""
    node.slots[tier] = slots
    tree.num_blocks_in[tier] += node.num_blocks
    node.parent.kids_in[tier] += 1


def drop_residency(tree, node: Node, tier: int) -> bool:
    """``RadixTree.drop_residency`` without the eviction queues; returns ``forgotten``."""
    node.slots[tier] = None
    tree.num_blocks_in[tier] -= node.num_blocks
    parent = node.parent
    parent.kids_in[tier] -= 1
    slots = node.slots
    if slots[0] is None and slots[1] is None and slots[2] is None:
        assert not node.children, "a node resident nowhere still has children"
        del parent.children[node.key]
        return True
    return False


class Replayer:
    """Applies records to ``tree`` (already holding the checkpoint).

    Fields:
        where: block hash -> node holding it (roots under their namespace hash); built on the
            first record that names a block.
        seqs: seq_id -> ``[session_id, node, extra]`` for sequences not yet released.
    """

    def __init__(self, tree, seqs: dict, block_bytes: int) -> None:
        self.tree = tree
        self.block_bytes = block_bytes
        self.seqs = seqs
        self.where: dict[bytes, Node] | None = None
        self.records = 0
        self.max_seq_id = 0  # the highest sequence id an OPEN or FORK record named
        self._ckpt: tuple | None = None  # (nodes, flat hashes, first block of each node)

    def use_checkpoint(self, nodes: list[Node], hashes: bytes) -> None:
        """Index the checkpoint's runs by their first and last hash only; any other block of
        theirs is found in ``hashes`` (the checkpoint's flat hash column) when a record names
        it. Call before the first record."""
        starts, total = [], 0
        for node in nodes:
            starts.append(total)
            total += node.num_blocks
        self._ckpt = (nodes, hashes, starts)

    # -- the hash map ------------------------------------------------------------------------

    def _build_map(self) -> dict[bytes, Node]:
        if self._ckpt is not None:
            where = {}
            for node in self._ckpt[0]:
                hashes = node.hashes
                where[hashes[0]] = node
                where[hashes[-1]] = node
            for root in self.tree.roots.values():
                where[root.hashes[-1]] = root
            self.where = where
            return where
        nodes = list(self.tree.nodes())
        where = dict(zip(chain.from_iterable([n.hashes for n in nodes]),
                         chain.from_iterable([repeat(n, n.num_blocks) for n in nodes])))
        for root in self.tree.roots.values():
            where[root.hashes[-1]] = root
        self.where = where
        return where

    def _node_of(self, h: bytes) -> Node:
        where = self.where
        if where is None:
            where = self._build_map()
        node = where.get(h)
        if node is None:
            node = self._inside_checkpoint_run(h)
            if node is None:
                raise ReplayError(f"record names block {h.hex()} that is not in the index")
        return node

    def _inside_checkpoint_run(self, h: bytes) -> Node | None:
        """The checkpoint run that still holds ``h`` inside it, if any.

        Every block that left its checkpoint run did so by a split, whose head went into
        ``where`` whole; so a block not in ``where`` is either still in its checkpoint run or
        gone (its run forgotten, or the split head holding it forgotten).
        """
        if self._ckpt is None:
            return None
        nodes, flat, starts = self._ckpt
        i = flat.find(h)
        while i >= 0 and i % H:
            i = flat.find(h, i + 1)
        if i < 0:
            return None
        node = nodes[bisect_right(starts, i // H) - 1]
        slots = node.slots
        if (slots[0] is None and slots[1] is None and slots[2] is None) or h not in node.hashes:
            return None
        return node

    def ending_at(self, h: bytes) -> Node:
        """The node whose last block is ``h`` (splitting the run holding it if needed)."""
        node = self._node_of(h)
        hashes = node.hashes
        if hashes[-1] == h or node.parent is None:
            return node
        head = split(node, hashes.index(h) + 1, self.block_bytes)
        self.where.update(dict.fromkeys(head.hashes, head))
        return head

    def run(self, first: bytes, last: bytes) -> Node:
        """The node holding exactly the run ``first .. last`` (cut at both ends as needed)."""
        node = self._node_of(first)
        if node.hashes[0] != first:
            head = split(node, node.hashes.index(first), self.block_bytes)
            self.where.update(dict.fromkeys(head.hashes, head))
        node = self.ending_at(last)
        if node.hashes[0] != first:
            raise ReplayError(f"run {first.hex()}.. spans more than one node")
        return node

    # -- records -----------------------------------------------------------------------------

    def apply(self, rec) -> None:
        """Apply one ``prefixd.wal.Record``.

        Raises:
            ReplayError: the record does not fit the state reached.
        """
        lsn, kind, f, blob = rec
        self.records += 1
        tree = self.tree
        if kind == _DROP:
            n = f[1]
            node = self.run(blob[:H], blob[(n - 1) * H:n * H])
            tier = f[0]
            if node.slots[tier] is None:
                raise ReplayError(f"BLOCK_DROP lsn {lsn}: run not resident in tier {tier}")
            if drop_residency(tree, node, tier):
                self.forget(node)
        elif kind == _MOVE:
            n = f[1]
            node = self.run(blob[:H], blob[(n - 1) * H:n * H])
            tier = f[0]
            if node.slots[tier] is not None:
                raise ReplayError(f"BLOCK_MOVE lsn {lsn}: run already resident in tier {tier}")
            set_residency(tree, node, tier, list(_unpacker("I", n)(blob, n * H)))
            if len(blob) > n * (H + 4):
                node.checksums = list(_unpacker("Q", n)(blob, n * (H + 4)))
        elif kind == _PUT:
            n, bb = f[1], self.block_bytes
            parent = self.ending_at(blob[:H])
            hashes = list(_unpacker("16s", n)(blob, H)) if n else []
            t0 = H + n * H
            tokens = blob[t0:t0 + n * bb]
            key = tokens[:bb]
            if key in parent.children:
                raise ReplayError(f"BLOCK_PUT lsn {lsn}: the run is already indexed")
            node = Node(parent, key, tokens, n, hashes, [None, None, None], tree.clock)
            parent.children[key] = node
            set_residency(tree, node, DEVICE, list(_unpacker("I", n)(blob, t0 + n * bb)))
            self.where.update(dict.fromkeys(hashes, node))
        elif kind == _OPEN:
            seq_id, session_id = f[0], f[1]
            deepest, extra = blob[:H], blob[H:]
            if extra not in tree.roots:
                root = tree.root(extra)
                if self.where is not None:
                    self.where[root.hashes[-1]] = root
            node = tree.roots[extra] if deepest == ZERO_HASH else self.ending_at(deepest)
            clock = tree.clock = tree.clock + 1
            n = node
            while n.parent is not None:
                n.last_access = clock
                n.hit_count += 1
                n = n.parent
            self.seqs[seq_id] = [session_id, node, extra]
            if seq_id > self.max_seq_id:
                self.max_seq_id = seq_id
        elif kind == _RELEASE:
            self.seqs.pop(f[0], None)
        elif kind == _COMMIT:
            seq = self.seqs.get(f[0])
            if seq is not None:
                tree.clock += 1
                seq[1] = self.ending_at(blob)
                seq[1].last_access = tree.clock
        elif kind == _FORK:
            self.max_seq_id = max(self.max_seq_id, f[1] + f[2] - 1)
            parent = self.seqs.get(f[0])
            if parent is not None:
                for child in range(f[1], f[1] + f[2]):
                    self.seqs[child] = list(parent)
        elif kind == _RECOVER:
            reconcile(tree, keep_host=bool(f[1]), seqs=self.seqs, replayer=self)
        # ATTACH, DETACH, EXTEND, COW, TOUCH: nothing that outlives a restart

    def forget(self, node: Node) -> None:
        node.checksums = None
        where = self.where
        if where is not None:
            get = where.get
            for h in node.hashes:
                if get(h) is node:
                    del where[h]


def reconcile(tree, *, keep_host: bool, seqs: dict, replayer: Replayer | None = None,
              order: list[Node] | None = None) -> int:
    """Drop what does not survive a restart; returns the number of runs forgotten.

    Children before parents, so that a run is forgotten only once nothing below it needs it.
    Eviction queues are not maintained (the caller rebuilds them). ``order``: every node,
    parents before children, if the caller already has it.
    """
    if order is None:
        order = list(tree.nodes())
    forgotten = 0
    tiers = (DEVICE,) if keep_host else (DEVICE, HOST)
    for node in reversed(order):
        slots = node.slots
        for tier in tiers:
            if slots[tier] is not None and drop_residency(tree, node, tier):
                forgotten += 1
                if replayer is not None:
                    replayer.forget(node)
    for seq in seqs.values():
        seq[1] = surviving(seq[1])
    return forgotten


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


__all__ = ["Replayer", "ReplayError", "reconcile", "surviving", "namespace_hash"]
