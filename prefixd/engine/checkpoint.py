"""The engine's checkpoint: what one holds and when one is due.

A checkpoint folds the log into the whole index: ``dump`` / ``load`` turn the tree into a few
columnar arrays (tree order) and back, and ``CheckpointTrigger`` says when one is due. Taking
one is ``Upkeep.checkpoint``: a picture of the state on the engine's thread, its bytes (the
values ``dump_engine`` makes) anywhere (``prefixd.engine.checkpointer``), the write through the
WAL, which stores it (``prefixd.wal.checkpoint_store``: chunked, checksummed values, and the
log truncated in the same transaction).

Layout (``index`` values; arrays are little-endian numpy buffers):

* ``nodes.parent`` i32: index of the parent node in this table, or ``-1 - r`` for root ``r``;
  parents come before children (depth-first order).
* ``nodes.blocks`` i32, ``nodes.last_access`` i64, ``nodes.hits`` i64, ``nodes.priority`` i32,
  ``nodes.flags`` u8: bit ``1 << t`` when resident in tier ``t`` (device 0, host 1, disk 2),
  bit ``8`` when the run's checksums are known.
* ``blocks.hashes`` (16 bytes each), ``blocks.tokens`` (``block_bytes`` each): one entry per
  block, in node order.
* ``blocks.host`` / ``blocks.disk`` u32 slots and ``blocks.sums`` u64: entries only for the
  nodes whose flag says so, in node order. Device slots are not saved: device residency never
  survives a restart (recovery drops it), but whether a run was on the device is (the log
  after the checkpoint may drop it from there).
* ``roots``: msgpack list of ``[extra, root_hash]``; ``meta``: msgpack map (block size, clock,
  next sequence id, store file ids).

``seqs`` holds one msgpack value ``seqs``: ``[[seq_id, session_id, deepest_hash, extra], ...]``.

NOTE: nodes, not blocks, are the unit of the Python loop on load (a million blocks are tens of
thousands of runs); per-block data moves as whole arrays.
"""

from __future__ import annotations

import gc
import time
from itertools import chain
from typing import NamedTuple

import msgpack
import numpy as np

from prefixd.engine.errors import StateFormatError
from prefixd.cache.node import DEVICE, DISK, HOST, Node, new_root
from prefixd.engine.packed_node import PackedNode, packed_checksums, packed_hashes
from prefixd.engine.records import CHECKPOINT_BLOCKS, RECORDS_VERSION, ZERO_HASH


def dump(cache, extra_meta: dict, seqs: list) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """``(index, seqs)`` values for ``Wal.checkpoint``."""
    tree = cache.tree
    parents, nblocks, last, hits, prio, flags = [], [], [], [], [], []
    hashes, tokens, host, disk, sums = [], [], [], [], []
    roots = list(tree.roots.items())
    index_of: dict[int, int] = {}
    for r, (_, root) in enumerate(roots):
        stack = [(child, -1 - r) for child in reversed(list(root.children.values()))]
        while stack:
            node, parent = stack.pop()
            index_of[id(node)] = len(parents)
            parents.append(parent)
            n = node.num_blocks
            nblocks.append(n)
            last.append(node.last_access)
            hits.append(node.hit_count)
            prio.append(node.priority)
            hashes.append(packed_hashes(node))  # a run loaded by a restart and not read since: as loaded
            tokens.append(node.tokens)
            on_device, on_host, on_disk = node.slots
            if on_host is not None:
                host += on_host
            if on_disk is not None:
                disk += on_disk
            node_sums = packed_checksums(node)
            if node_sums is not None:
                sums.append(node_sums)
            flags.append((on_device is not None) | (on_host is not None) << 1 | (on_disk is not None) << 2
                         | (node_sums is not None) << 3)
            me = index_of[id(node)]
            stack.extend((child, me) for child in reversed(list(node.children.values())))
    index = {
        b"nodes.parent": np.asarray(parents, "<i4").tobytes(),
        b"nodes.blocks": np.asarray(nblocks, "<i4").tobytes(),
        b"nodes.last_access": np.asarray(last, "<i8").tobytes(),
        b"nodes.hits": np.asarray(hits, "<i8").tobytes(),
        b"nodes.priority": np.asarray(prio, "<i4").tobytes(),
        b"nodes.flags": np.asarray(flags, "u1").tobytes(),
        b"blocks.hashes": b"".join(hashes),
        b"blocks.tokens": b"".join(tokens),
        b"blocks.host": np.asarray(host, "<u4").tobytes(),
        b"blocks.disk": np.asarray(disk, "<u4").tobytes(),
        b"blocks.sums": b"".join(sums),
        b"roots": msgpack.packb([[extra, root.hashes[-1]] for extra, root in roots]),
        b"meta": msgpack.packb({"block_size": cache.block_size, "clock": tree.clock,
                                "records_version": RECORDS_VERSION, **extra_meta}),
    }
    return index, {b"seqs": msgpack.packb(seqs)}


def whole(value) -> bytes:
    """A checkpoint value as one bytes object (``Wal.with_checkpoint`` gives chunk lists)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return b"".join(value)


def _column(value, dtype: str) -> list:
    """A numpy column's items as a list, from a whole value or its chunks (each chunk holds a
    whole number of items: chunks are 1 MiB), without joining the chunks first."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, dtype).tolist()
    out: list = []
    for chunk in value:
        out += np.frombuffer(chunk, dtype).tolist()
    return out


class _Items:
    """A per-block column given whole or as equal-size chunks (each a whole number of items:
    chunks are 1 MiB), read in place: ``tolist(a, b)`` lists items ``a .. b - 1``.

    NOTE: the chunks are not joined: host and disk slots, checksums and hashes are ~30 MB at
    1M blocks, and each node's items are read once, from the chunk that holds them (valid
    only inside the read transaction, like the chunks)."""

    __slots__ = ("arrays", "per", "size")

    def __init__(self, value, dtype: str) -> None:
        chunks = [value] if isinstance(value, (bytes, bytearray, memoryview)) else list(value)
        arrays = [np.frombuffer(c, dtype) for c in chunks] or [np.zeros(0, dtype)]
        if any(len(a) != len(arrays[0]) for a in arrays[:-1]):
            raise ValueError("checkpoint chunks of one value differ in size")
        self.arrays = arrays
        self.per = max(len(arrays[0]), 1)
        self.size = sum(len(a) for a in arrays)

    def tolist(self, a: int, b: int) -> list:
        per = self.per
        i = a // per
        at = i * per
        if b - at <= per:  # within one chunk: the usual case
            return self.arrays[i][a - at:b - at].tolist()
        out: list = []
        while a < b:
            i = a // per
            end = min(b, (i + 1) * per)
            out += self.arrays[i][a - i * per:end - i * per].tolist()
            a = end
        return out


class _Slices:
    """Byte ranges of a value given whole or as equal-size chunks, each copied once."""

    def __init__(self, value) -> None:
        chunks = [value] if isinstance(value, (bytes, bytearray, memoryview)) else list(value)
        self.chunks = chunks
        self.size = max(len(chunks[0]), 1) if chunks else 1
        if any(len(c) != self.size for c in chunks[:-1]):
            raise ValueError("checkpoint chunks of one value differ in size")

    def get(self, a: int, b: int) -> bytes:
        size, chunks = self.size, self.chunks
        i = a // size
        at = i * size
        if b - at <= size:  # within one chunk: the usual case
            return bytes(chunks[i][a - at:b - at])
        j = (b - 1) // size
        return b"".join([chunks[i][a - at:], *chunks[i + 1:j], chunks[j][:b - j * size]])


class PlacedSlots:
    """The host and disk slot lists a checkpoint load placed, in column order, with their
    columns, so that recovery lists the slots of the final tree (``used``) without reading
    a million Python ints back one by one.

    NOTE: a node's slot list is never changed in place (a split, a move or a drop replaces
    or clears it), so a list that is still one the load placed holds exactly its column
    range. The lists stay referenced here, so no other list can take the id of one of them
    while this lives.
    """

    def __init__(self) -> None:
        self.lists: dict[int, list[list[int]]] = {HOST: [], DISK: []}
        self.columns: dict[int, np.ndarray] = {HOST: np.zeros(0, "<u4"), DISK: np.zeros(0, "<u4")}

    def used(self, slot_lists: list[list | None], tier: int) -> np.ndarray:
        """Every slot of ``tier`` in ``slot_lists`` (each node's ``slots``), as int64: the
        column ranges of lists the load placed, then the items of any other."""
        at, pos = {}, 0
        for placed in self.lists[tier]:
            at[id(placed)] = pos
            pos += len(placed)
        starts, lens, others = [], [], []
        get = at.get
        for slots in slot_lists:
            s = slots[tier]
            if s is not None:
                p = get(id(s))
                if p is None:
                    others.append(s)
                else:
                    starts.append(p)
                    lens.append(len(s))
        lens_a = np.asarray(lens, np.int64)
        offsets = np.cumsum(lens_a) - lens_a  # where each range starts in the result
        idx = np.arange(int(lens_a.sum()), dtype=np.int64) + np.repeat(np.asarray(starts, np.int64) - offsets, lens_a)
        rest = np.fromiter(chain.from_iterable(others), np.int64, count=sum(map(len, others)))
        return np.concatenate([self.columns[tier][idx].astype(np.int64), rest])


def check_format(index: dict, state_dir: str) -> None:
    """Refuse a checkpoint (and so the log after it) written with other record layouts.

    Raises:
        StateFormatError: the saved ``records_version`` is missing (format 1) or differs.
    """
    if not index:
        return
    saved = msgpack.unpackb(whole(index[b"meta"])).get("records_version", 1)
    if saved != RECORDS_VERSION:
        raise StateFormatError(state_dir, saved, RECORDS_VERSION)


class Loaded(NamedTuple):
    """What ``load`` rebuilt: the checkpoint's ``meta``, its ``nodes`` in file order, the
    first 8 bytes of every block hash as u64 in file order (``hash_lo``: replay searches
    them for a block named inside a checkpoint run), and the slot lists it ``placed``."""

    meta: dict
    nodes: list[Node]
    hash_lo: np.ndarray
    placed: PlacedSlots


def load(tree, index: dict, block_bytes: int) -> Loaded:
    """Rebuild ``tree`` (empty) from checkpoint values, each whole or as its chunk list.

    Residency is set with ``RadixTree.place`` (the caller rebuilds queues and allocators
    after replay).

    NOTE: nodes are ``PackedNode``s: each keeps its hashes and checksums as the bytes of its
    own column range until something reads them (a million hash objects and checksum ints
    were a fifth of a 1M-block recovery). Slot lists are made per node from the columns read
    in place, chunk by chunk (``_Items``): slicing million-item Python lists touched every
    item's refcount a second time, scattered over memory (0.1 s of a 1M-block load), and
    joining the columns first copied ~30 MB for nothing.
    """
    if not index:
        return Loaded({}, [], np.zeros(0, "<u8"), PlacedSlots())
    meta = msgpack.unpackb(whole(index[b"meta"]))
    tree.clock = meta["clock"]
    roots = []
    for extra, root_hash in msgpack.unpackb(whole(index[b"roots"])):
        root = tree.roots[extra] = new_root(root_hash)
        roots.append(root)
    parents = _column(index[b"nodes.parent"], "<i4")
    starts = np.concatenate([[0], np.cumsum(_column(index[b"nodes.blocks"], "<i4"), dtype=np.int64)]).tolist()
    last = _column(index[b"nodes.last_access"], "<i8")
    hits = _column(index[b"nodes.hits"], "<i8")
    prio = _column(index[b"nodes.priority"], "<i4")
    flags = _column(index[b"nodes.flags"], "u1")
    tokens = _Slices(index[b"blocks.tokens"])
    host_col, disk_col = _Items(index[b"blocks.host"], "<u4"), _Items(index[b"blocks.disk"], "<u4")
    sums_col, hashes_col = _Items(index[b"blocks.sums"], "<u8"), _Items(index[b"blocks.hashes"], "V16")
    host, disk = host_col.tolist, disk_col.tolist
    sums, hashes = _Slices(index[b"blocks.sums"]).get, _Slices(index[b"blocks.hashes"]).get
    at_host = at_disk = at_sums = 0
    placed = PlacedSlots()
    host_lists, disk_lists = placed.lists[HOST], placed.lists[DISK]
    nodes: list[Node] = []
    append = nodes.append
    place = tree.place  # residency bookkeeping, queues rebuilt after recovery
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i, parent_ref in enumerate(parents):
            a, b = starts[i], starts[i + 1]
            parent = nodes[parent_ref] if parent_ref >= 0 else roots[-1 - parent_ref]
            n = b - a
            toks = tokens.get(a * block_bytes, b * block_bytes)
            f = flags[i]
            packed_sums = None
            if f & 8:
                packed_sums = sums(at_sums * 8, (at_sums + n) * 8)
                at_sums += n
            node = PackedNode(parent, toks[:block_bytes], toks, n, hashes(a * 16, b * 16), packed_sums,
                              [None, None, None], last[i])
            node.hit_count = hits[i]
            node.priority = prio[i]
            if f & 1:
                place(node, DEVICE, [-1] * n)  # only the fact survives: see the module docstring
            if f & 2:
                host_lists.append(slots := host(at_host, at_host + n))
                place(node, HOST, slots)
                at_host += n
            if f & 4:
                disk_lists.append(slots := disk(at_disk, at_disk + n))
                place(node, DISK, slots)
                at_disk += n
            parent.children[node.key] = node
            append(node)
    finally:
        if enabled:
            gc.enable()
    if (at_host, at_disk, at_sums) != (host_col.size, disk_col.size, sums_col.size):
        raise ValueError(f"checkpoint columns disagree with node flags: used {at_host}/{host_col.size} host, "
                         f"{at_disk}/{disk_col.size} disk slots and {at_sums}/{sums_col.size} checksums")
    if starts[-1] != hashes_col.size:
        raise ValueError(f"checkpoint nodes hold {starts[-1]} blocks but {hashes_col.size} hashes")
    # copied out of the chunks (they outlive the transaction): the first 8 bytes of each
    # hash, and the slot columns
    hash_lo = np.concatenate([arr.view("<u8")[0::2] for arr in hashes_col.arrays])
    placed.columns = {HOST: np.concatenate(host_col.arrays), DISK: np.concatenate(disk_col.arrays)}
    return Loaded(meta, nodes, hash_lo, placed)


def dump_engine(cache, sessions: dict, recovered, file_ids: dict) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """The checkpoint values of a durable cache: ``dump`` of its tree, its live and recovered
    sequences (``engine_seqs``), the next sequence id and the tier files' ids (``engine_meta``)."""
    return dump(cache, engine_meta(cache, file_ids), engine_seqs(cache, sessions, recovered))


def engine_seqs(cache, sessions: dict, recovered) -> list:
    """The ``seqs`` a checkpoint stores: each live and recovered sequence named by its deepest
    node's last hash (``sessions``: live seq id -> session id; ``recovered``: ``RecoveredSeq``s)."""
    seqs = [[seq.id, sessions.get(seq.id, 0), _deepest_hash(seq.node), seq.extra]
            for seq in cache.sequences()]
    seqs += [[rec.seq_id, rec.session_id, _deepest_hash(rec.node), rec.extra] for rec in recovered]
    return seqs


def engine_meta(cache, file_ids: dict) -> dict:
    """The durable engine's part of a checkpoint's ``meta``: the next sequence id and the tier
    files' ids."""
    return {"next_seq_id": cache.next_seq_id,
            "file_ids": {str(int(t)): fid.hex() for t, fid in file_ids.items()}}


def _deepest_hash(node) -> bytes:
    return node.hashes[-1] if node.parent is not None else ZERO_HASH


NO_SPACE_RETRY_S = 5.0  # a checkpoint that met a full filesystem is tried again after this


class CheckpointTrigger:
    """When the log is folded into a checkpoint: after ``records`` records, or once replaying
    the records since the last one would decode ``blocks`` blocks (``records.Scan.blocks``; see
    ``prefixd.engine.records.CHECKPOINT_BLOCKS``), whichever comes first.

    Both bounds are settable while serving (``prefixd.engine.live_settings``). Invariants:
    ``tail_records`` and ``tail_blocks`` count what was logged since the last checkpoint (the
    replayed tail included after a restart) and are never negative.
    """

    def __init__(self, records: int, blocks: int = CHECKPOINT_BLOCKS) -> None:
        self.records = records
        self.blocks = blocks
        self.tail_records = 0
        self.tail_blocks = 0
        self.not_before = 0.0  # ``postpone``: no checkpoint is due before (monotonic seconds)

    def count(self, records: int, blocks: int) -> None:
        """``records`` more records were logged, decoding ``blocks`` blocks on replay."""
        self.tail_records += records
        self.tail_blocks += blocks

    def due(self) -> bool:
        if self.tail_records < self.records and self.tail_blocks < self.blocks:
            return False
        return not self.not_before or time.monotonic() >= self.not_before

    def postpone(self, seconds: float) -> None:
        """A checkpoint could not be written (a full filesystem): none is due for ``seconds``."""
        self.not_before = time.monotonic() + seconds

    def taken(self, records: int, blocks: int) -> None:
        """A checkpoint folded the ``records`` and ``blocks`` counted when it was pictured
        (``Picture.take``); what was logged since counts towards the next one."""
        self.tail_records = max(self.tail_records - records, 0)
        self.tail_blocks = max(self.tail_blocks - blocks, 0)
        self.not_before = 0.0

    def check_invariants(self) -> None:
        assert self.tail_records >= 0 and self.tail_blocks >= 0, "negative checkpoint tail"
