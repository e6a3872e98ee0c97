"""Replay: apply logged records to a tree loaded from the checkpoint, then reconcile.

Records name blocks by hash; ``Replayer`` keeps a hash -> node map and cuts a run where a
record names a block inside it (every live split was caused by a logged operation, so replay
reproduces it). Sequences are tracked as ``[session_id, deepest node, extra]``: their private
blocks never survive, so EXTEND and COW records carry nothing replay needs.

Record layouts are ``prefixd.engine.records``'s (the encoder's module: its ``decode_*`` and the
``RUN`` offsets); residency changes go through ``RadixTree.place`` / ``unplace``, the same
bookkeeping live operations use.

At a RECOVER record (and at the end of the log) it reconciles as that restart did
(``prefixd.engine.reconcile``).

NOTE: replay runs once per record of a log tail (100k records name millions of blocks), so it
touches blocks only where a record brings new per-block data (BLOCK_PUT, BLOCK_MOVE): a run is
found from its first and last hash (all a move or drop record names); residency changes
skip the eviction queues (``rebuild_queues`` replaces them after recovery); the hash map is
built on first use. After a checkpoint it holds only the first and last hash of each
checkpoint run (a 1M-block map cost a quarter of a second to build): a record naming a block
inside such a run, which is rare (a match ending inside a run), finds it by a numpy compare
over the checkpoint's hashes instead.
"""

from __future__ import annotations

import logging
import struct
from bisect import bisect_right
from itertools import chain, repeat

import numpy as np

from prefixd.cache.node import DEVICE, Node, split
from prefixd.engine import records
from prefixd.engine.packed_node import run_ends
from prefixd.engine.reconcile import reconcile, shallow_first
from prefixd.engine.records import RUN, unpacker
from prefixd.wal.codec import CRC_SIZE, encode
from prefixd.wal.kinds import Kind

log = logging.getLogger(__name__)

_PUT, _MOVE, _DROP = int(Kind.BLOCK_PUT), int(Kind.BLOCK_MOVE), int(Kind.BLOCK_DROP)
_OPEN, _COMMIT, _FORK = int(Kind.OPEN), int(Kind.COMMIT), int(Kind.FORK)
_RELEASE, _RECOVER = int(Kind.RELEASE), int(Kind.RECOVER)

# A move's or drop's parts, as offsets into the raw value (``prefixd.engine.records.RUN``).
_CRC = CRC_SIZE
_TIER, _COUNT, _FIRST, _LAST, _BODY = RUN
_U32 = struct.Struct("<I").unpack_from


class ReplayError(Exception):
    """A record does not fit the state replay reached: the log and checkpoint disagree."""


class Replayer:
    """Applies records to ``tree`` (already holding the checkpoint).

    Fields:
        where: block hash -> node holding it (roots under their namespace hash); built on the
            first record that names a block.
        seqs: seq_id -> ``[session_id, node, extra]`` for sequences not yet released.
        device_runs: every node given device residency since the last restart, appended as it
            happens (duplicates and nodes since dropped included; ``restart`` filters them).
    """

    def __init__(self, tree, seqs: dict, block_bytes: int) -> None:
        self.tree = tree
        self.block_bytes = block_bytes
        self.seqs = seqs
        self.where: dict[bytes, Node] | None = None
        self.runs: dict[bytes, Node] = {}  # first hash || last hash -> the node that is exactly that run
        self.records = 0
        self.blocks = 0  # blocks decoded one by one (``prefixd.engine.records.Scan.blocks``)
        self.device_runs: list[Node] = []
        self.max_seq_id = 0  # the highest sequence id an OPEN or FORK record named
        self.device_runs_missed = 0  # restarts whose device runs were not all tracked (a bug)
        # (nodes, the first 8 bytes of every block hash as u64, first block of each node)
        self._ckpt: tuple | None = None

    def use_checkpoint(self, nodes: list[Node], hash_lo: np.ndarray) -> None:
        """Index the checkpoint's runs by their first and last hash only; any other block of
        theirs is found through ``hash_lo`` (the first 8 bytes of every checkpoint block's
        hash as u64, in node order, as ``checkpoint.load`` returns them) when a record names it.
        Call before the first record."""
        starts, total = [], 0
        for node in nodes:
            starts.append(total)
            total += node.num_blocks
        self._ckpt = (nodes, hash_lo, starts)
        self.device_runs += [node for node in nodes if node.slots[DEVICE] is not None]

    # -- the hash map ------------------------------------------------------------------------

    def _build_map(self) -> dict[bytes, Node]:
        if self._ckpt is not None:
            where, runs = {}, self.runs
            for node in self._ckpt[0]:
                first, last = run_ends(node)  # a loaded run's hashes stay packed
                where[first] = node
                where[last] = node
                runs[first + last] = node
            for root in self.tree.roots.values():
                where[root.hashes[-1]] = root
            self.where = where
            return where
        nodes = list(self.tree.nodes())
        where = dict(zip(chain.from_iterable([n.hashes for n in nodes]),
                         chain.from_iterable([repeat(n, n.num_blocks) for n in nodes])))
        self.runs = {n.hashes[0] + n.hashes[-1]: n for n in nodes}
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
        nodes, hash_lo, starts = self._ckpt
        for i in np.flatnonzero(hash_lo == int.from_bytes(h[:8], "little")).tolist():
            node = nodes[bisect_right(starts, i) - 1]
            slots = node.slots
            if (slots[0] is not None or slots[1] is not None or slots[2] is not None) and h in node.hashes:
                return node  # h itself: its first 8 bytes may be another's, or a split moved it
        return None

    def ending_at(self, h: bytes) -> Node:
        """The node whose last block is ``h`` (splitting the run holding it if needed)."""
        node = self._node_of(h)
        if node.parent is None or node.last_hash == h:  # (a loaded run stays packed)
            return node
        return self._split(node, node.hashes.index(h) + 1)

    def run(self, first: bytes, last: bytes, n: int, lsn: int = 0) -> Node:
        """The node holding exactly the ``n`` blocks ``first .. last`` (cut at both ends as needed)."""
        node = self._node_of(first)
        if node.hashes[0] != first:
            self._split(node, node.hashes.index(first))
        node = self.ending_at(last)
        if node.hashes[0] != first or node.num_blocks != n:
            raise ReplayError(f"lsn {lsn}: run {first.hex()}..{last.hex()} of {n} blocks is not one run of the index")
        return node

    def _split(self, node: Node, k: int) -> Node:
        """``node.split`` that keeps ``where`` and ``runs`` right; returns the head."""
        runs, where = self.runs, self.where
        old = node.hashes[0] + node.hashes[-1]
        if runs.get(old) is node:
            del runs[old]
        head = split(node, k, self.block_bytes)
        if head.slots[DEVICE] is not None:
            self.device_runs.append(head)
        where.update(dict.fromkeys(head.hashes, head))
        where[node.hashes[0]] = node  # the tail's new first block: records name runs by it
        runs[head.hashes[0] + head.hashes[-1]] = head
        runs[node.hashes[0] + node.hashes[-1]] = node
        return head

    # -- records -----------------------------------------------------------------------------

    def apply(self, rec) -> None:
        """Apply one ``prefixd.wal.Record``; see ``apply_batches``."""
        self.apply_batches([(rec.lsn, [encode(rec.kind, rec.fields, rec.blob)])])

    def apply_batches(self, batches) -> None:
        """Apply verified raw record values, ``(lsn of the first, [value, ...])`` per batch as
        ``Wal.replay_batches`` yields them.

        NOTE: this loop runs once per record of the log tail (a 100k-record tail is most of a
        recovery), so moves and drops, most of any log, are decoded and applied inline
        straight from the value: the run is looked up by its last hash and is usually exactly
        one node. Device slots are not decoded: device residency never survives a restart
        (``reconcile`` drops it), so replay only needs to know that a run was on the device.

        Raises:
            ReplayError: a record does not fit the state reached.
        """
        tree = self.tree
        if self.where is None:
            self._build_map()
        get_run = self.runs.get
        place, unplace = tree.place, tree.unplace
        seqs = self.seqs
        u32 = _U32
        decode_seq_id = records.decode_seq_id
        count = blocks = 0
        lsn = 0
        try:
            for lsn, values in batches:
                for value in values:
                    kind = value[0]
                    if kind == _DROP or kind == _MOVE:  # inline: see NOTE (offsets: records.RUN)
                        tier = value[_TIER]
                        node = get_run(value[_FIRST:_BODY])  # usually the run is exactly one node
                        if node is None:
                            node = self.run(value[_FIRST:_LAST], value[_LAST:_BODY], u32(value, _COUNT)[0], lsn)
                        n = node.num_blocks
                        if kind == _DROP:
                            if node.slots[tier] is None:
                                raise ReplayError(f"BLOCK_DROP lsn {lsn}: run not resident in tier {tier}")
                            if unplace(node, tier)[1]:
                                self.forget(node)
                                blocks += n
                        else:
                            if node.slots[tier] is not None:
                                raise ReplayError(f"BLOCK_MOVE lsn {lsn}: run already resident in tier {tier}")
                            at = _BODY
                            if tier == DEVICE:  # the record carries no device slots
                                place(node, tier, [-1] * n)
                                self.device_runs.append(node)
                            else:
                                place(node, tier, list(unpacker("I", n)(value, at)))
                                at += 4 * n
                                blocks += n
                            if len(value) > at + _CRC:  # new or changed checksums
                                node.checksums = list(unpacker("Q", n)(value, at))
                    elif kind == _PUT:
                        blocks += self._put(lsn, value)
                    elif kind == _OPEN:
                        self._open(*records.decode_open(value))
                    elif kind == _RELEASE:
                        seqs.pop(decode_seq_id(value), None)
                    elif kind == _COMMIT:
                        seq_id, last_hash = records.decode_commit(value)
                        seq = seqs.get(seq_id)
                        if seq is not None:
                            tree.clock += 1
                            seq[1] = self.ending_at(last_hash)
                            seq[1].last_access = tree.clock
                    elif kind == _FORK:
                        parent_id, first_child, num_children = records.decode_fork(value)
                        self.max_seq_id = max(self.max_seq_id, first_child + num_children - 1)
                        parent = seqs.get(parent_id)
                        if parent is not None:
                            for child in range(first_child, first_child + num_children):
                                seqs[child] = list(parent)
                    elif kind == _RECOVER:
                        self.restart(keep_host=records.decode_recover(value)[1])
                    # ATTACH, DETACH, EXTEND, COW, TOUCH: nothing that outlives a restart
                    lsn += 1
                    count += 1
        except (struct.error, IndexError, ValueError) as exc:
            # a record whose checksum holds but whose blob does not fit its kind (written by
            # another layout, see RECORDS_VERSION) or the tree (a drop that would leave
            # children behind), or a bug: recovery stops rather than guess
            raise ReplayError(f"lsn {lsn}: record does not fit its kind's layout or the index: {exc}") from None
        finally:
            self.records += count
            self.blocks += blocks

    def _put(self, lsn: int, value) -> int:
        """A BLOCK_PUT: a new run, device-resident (slots not decoded); returns its blocks."""
        tree, bb = self.tree, self.block_bytes
        parent_hash, hashes, tokens = records.decode_put(value)
        n = len(hashes)
        if len(tokens) != n * bb:
            raise ReplayError(f"BLOCK_PUT lsn {lsn}: {len(tokens)} token bytes for {n} blocks of {bb}")
        parent = self.ending_at(parent_hash)
        key = tokens[:bb]
        if key in parent.children:
            raise ReplayError(f"BLOCK_PUT lsn {lsn}: the run is already indexed")
        node = Node(parent, key, tokens, n, hashes, [None, None, None], tree.clock)
        parent.children[key] = node
        tree.place(node, DEVICE, [-1] * n)  # device slots never survive: not decoded
        self.device_runs.append(node)
        self.where.update(dict.fromkeys(hashes, node))
        if hashes:
            self.runs[hashes[0] + hashes[-1]] = node
        return n

    def _open(self, seq_id: int, session_id: int, deepest: bytes, extra: bytes) -> None:
        tree = self.tree
        if extra not in tree.roots:
            root = tree.root(extra)
            self.where[root.hashes[-1]] = root
        node = self.ending_at(deepest) if deepest else tree.roots[extra]
        clock = tree.clock = tree.clock + 1
        n = node
        while n.parent is not None:
            n.last_access = clock
            n.hit_count += 1
            n = n.parent
        self.seqs[seq_id] = [session_id, node, extra]
        if seq_id > self.max_seq_id:
            self.max_seq_id = seq_id

    def restart(self, keep_host: bool) -> None:
        """A RECOVER record: the reconciliation that restart did. When the host pool survived
        only device residency goes, so only the runs in ``device_runs`` are visited (a walk
        of the whole tree per restart in the tail cost 25 ms at 1M blocks), deepest first so
        that a run is forgotten only once nothing below it needs it.

        Should a device run have escaped ``device_runs`` (a bug: the tree's device count is
        not zero afterwards), the whole tree is walked as well, which is always right, the
        miss is logged and counted in ``device_runs_missed`` (tests require zero)."""
        order = shallow_first(self.device_runs) if keep_host else None
        reconcile(self.tree, keep_host=keep_host, seqs=self.seqs, forget=self.forget, order=order)
        if self.tree.num_blocks_in[DEVICE]:
            log.error("replay: %d device blocks were not among the tracked device runs; walking "
                      "the whole tree", self.tree.num_blocks_in[DEVICE])
            self.device_runs_missed += 1
            reconcile(self.tree, keep_host=keep_host, seqs=self.seqs, forget=self.forget)
        self.device_runs = []

    def forget(self, node: Node) -> None:
        node.checksums = None
        where = self.where
        if where is not None:
            get = where.get
            for h in node.hashes:
                if get(h) is node:
                    del where[h]
            key = node.hashes[0] + node.hashes[-1]
            if self.runs.get(key) is node:
                del self.runs[key]


__all__ = ["Replayer", "ReplayError"]
