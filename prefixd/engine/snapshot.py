"""The checkpoint: the whole index as a few columnar arrays (tree order), and back.

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

import msgpack
import numpy as np

from prefixd.engine.errors import StateFormatError
from prefixd.cache.node import DEVICE, DISK, HOST, Node, new_root
from prefixd.engine.records import RECORDS_VERSION, ZERO_HASH


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
            hashes += node.hashes
            tokens.append(node.tokens)
            on_device, on_host, on_disk = node.slots
            if on_host is not None:
                host += on_host
            if on_disk is not None:
                disk += on_disk
            if node.checksums is not None:
                sums += node.checksums
            flags.append((on_device is not None) | (on_host is not None) << 1 | (on_disk is not None) << 2
                         | (node.checksums is not None) << 3)
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
        b"blocks.sums": np.asarray(sums, "<u8").tobytes(),
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


def _array(value, dtype: str) -> np.ndarray:
    """A numpy column as one array that outlives the read transaction (chunks are copied once)."""
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(value, dtype)
    chunks = [value] if isinstance(value, memoryview) else value
    return np.concatenate([np.frombuffer(c, dtype) for c in chunks] or [np.zeros(0, dtype)])


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
        i, j = a // size, max(b - 1, a) // size
        if i == j:
            return bytes(chunks[i][a - i * size:b - i * size])
        return b"".join([chunks[i][a - i * size:], *chunks[i + 1:j], chunks[j][:b - j * size]])


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


def load(tree, index: dict, block_bytes: int) -> tuple[dict, list[Node], np.ndarray]:
    """Rebuild ``tree`` (empty) from checkpoint values, each whole or as its chunk list;
    returns ``(meta, nodes in file order, every block hash in file order)``, the hashes as a
    ``V16`` array: replay searches it for a block named inside a checkpoint run.

    Residency is set with ``RadixTree.place`` (the caller rebuilds queues and allocators
    after replay).

    NOTE: per-block columns stay numpy arrays and each node's lists are made from its own
    slice: slicing million-item Python lists touched every item's refcount a second time,
    scattered over memory (0.1 s of a 1M-block load).
    """
    if not index:
        return {}, [], np.zeros(0, "V16")
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
    host = _array(index[b"blocks.host"], "<u4")
    disk = _array(index[b"blocks.disk"], "<u4")
    sums = _array(index[b"blocks.sums"], "<u8")
    at_host = at_disk = at_sums = 0
    # V16 (not S16: that would strip trailing zero bytes) turns into bytes objects in C
    hashes = _array(index[b"blocks.hashes"], "V16")
    nodes: list[Node] = []
    place = tree.place  # residency bookkeeping, queues rebuilt after recovery
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i, parent_ref in enumerate(parents):
            a, b = starts[i], starts[i + 1]
            parent = nodes[parent_ref] if parent_ref >= 0 else roots[-1 - parent_ref]
            n = b - a
            toks = tokens.get(a * block_bytes, b * block_bytes)
            node = Node(parent, toks[:block_bytes], toks, n, hashes[a:b].tolist(), [None, None, None], last[i])
            node.hit_count = hits[i]
            node.priority = prio[i]
            f = flags[i]
            if f & 1:
                place(node, DEVICE, [-1] * n)  # only the fact survives: see the module docstring
            if f & 2:
                place(node, HOST, host[at_host:at_host + n].tolist())
                at_host += n
            if f & 4:
                place(node, DISK, disk[at_disk:at_disk + n].tolist())
                at_disk += n
            if f & 8:
                node.checksums = sums[at_sums:at_sums + n].tolist()
                at_sums += n
            parent.children[node.key] = node
            nodes.append(node)
    finally:
        if enabled:
            gc.enable()
    if (at_host, at_disk, at_sums) != (len(host), len(disk), len(sums)):
        raise ValueError(f"checkpoint columns disagree with node flags: used {at_host}/{len(host)} host, "
                         f"{at_disk}/{len(disk)} disk slots and {at_sums}/{len(sums)} checksums")
    return meta, nodes, hashes


def dump_engine(cache, sessions: dict, recovered, file_ids: dict) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """The checkpoint values of a durable cache: ``dump`` of its tree, its live and recovered
    sequences (each named by its deepest node's last hash), the next sequence id and the tier
    files' ids (``sessions``: live seq id -> session id; ``recovered``: ``RecoveredSeq``s)."""
    seqs = []
    for seq in cache.sequences():
        node = seq.node
        seqs.append([seq.id, sessions.get(seq.id, 0),
                     node.hashes[-1] if node.parent is not None else ZERO_HASH, seq.extra])
    for rec in recovered:
        node = rec.node
        seqs.append([rec.seq_id, rec.session_id,
                     node.hashes[-1] if node.parent is not None else ZERO_HASH, rec.extra])
    meta = {"next_seq_id": cache.next_seq_id,
            "file_ids": {str(int(t)): fid.hex() for t, fid in file_ids.items()}}
    return dump(cache, meta, seqs)
