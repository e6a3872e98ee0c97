"""The checkpoint: the whole index as a few columnar arrays (tree order), and back.

Layout (``index`` values; arrays are little-endian numpy buffers):

* ``nodes.parent`` i32: index of the parent node in this table, or ``-1 - r`` for root ``r``;
  parents come before children (depth-first order).
* ``nodes.blocks`` i32, ``nodes.last_access`` i64, ``nodes.hits`` i64, ``nodes.priority`` i32,
  ``nodes.has_sums`` u8.
* ``blocks.hashes`` (16 bytes each), ``blocks.tokens`` (``block_bytes`` each),
  ``blocks.device`` / ``blocks.host`` / ``blocks.disk`` i32 slots (-1: not resident),
  ``blocks.sums`` u64: one entry per block, in node order.
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

from prefixd.cache.errors import StateFormatError
from prefixd.cache.node import Node, new_root
from prefixd.cache.records import RECORDS_VERSION


def dump(cache, extra_meta: dict, seqs: list) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """``(index, seqs)`` values for ``Wal.checkpoint``."""
    tree = cache.tree
    parents, nblocks, last, hits, prio, has_sums = [], [], [], [], [], []
    hashes, tokens, dev, host, disk, sums = [], [], [], [], [], []
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
            for col, slots in zip((dev, host, disk), node.slots):
                col += slots if slots is not None else [-1] * n
            has_sums.append(node.checksums is not None)
            sums += node.checksums if node.checksums is not None else [0] * n
            me = index_of[id(node)]
            stack.extend((child, me) for child in reversed(list(node.children.values())))
    index = {
        b"nodes.parent": np.asarray(parents, "<i4").tobytes(),
        b"nodes.blocks": np.asarray(nblocks, "<i4").tobytes(),
        b"nodes.last_access": np.asarray(last, "<i8").tobytes(),
        b"nodes.hits": np.asarray(hits, "<i8").tobytes(),
        b"nodes.priority": np.asarray(prio, "<i4").tobytes(),
        b"nodes.has_sums": np.asarray(has_sums, "u1").tobytes(),
        b"blocks.hashes": b"".join(hashes),
        b"blocks.tokens": b"".join(tokens),
        b"blocks.device": np.asarray(dev, "<i4").tobytes(),
        b"blocks.host": np.asarray(host, "<i4").tobytes(),
        b"blocks.disk": np.asarray(disk, "<i4").tobytes(),
        b"blocks.sums": np.asarray(sums, "<u8").tobytes(),
        b"roots": msgpack.packb([[extra, root.hashes[-1]] for extra, root in roots]),
        b"meta": msgpack.packb({"block_size": cache.block_size, "clock": tree.clock,
                                "records_version": RECORDS_VERSION, **extra_meta}),
    }
    return index, {b"seqs": msgpack.packb(seqs)}


def check_format(index: dict[bytes, bytes], state_dir: str) -> None:
    """Refuse a checkpoint (and so the log after it) written with other record layouts.

    Raises:
        StateFormatError: the saved ``records_version`` is missing (format 1) or differs.
    """
    if not index:
        return
    saved = msgpack.unpackb(index[b"meta"]).get("records_version", 1)
    if saved != RECORDS_VERSION:
        raise StateFormatError(state_dir, saved, RECORDS_VERSION)


def load(tree, index: dict[bytes, bytes], block_bytes: int) -> tuple[dict, list[Node]]:
    """Rebuild ``tree`` (empty) from checkpoint values; returns ``(meta, nodes in file order)``.

    Residency is set directly (the caller rebuilds queues and allocators after replay).
    """
    if not index:
        return {}, []
    meta = msgpack.unpackb(index[b"meta"])
    tree.clock = meta["clock"]
    roots = []
    for extra, root_hash in msgpack.unpackb(index[b"roots"]):
        root = tree.roots[extra] = new_root(root_hash)
        roots.append(root)
    parents = np.frombuffer(index[b"nodes.parent"], "<i4").tolist()
    nblocks = np.frombuffer(index[b"nodes.blocks"], "<i4")
    starts = np.concatenate([[0], np.cumsum(nblocks, dtype=np.int64)]).tolist()
    nblocks = nblocks.tolist()
    last = np.frombuffer(index[b"nodes.last_access"], "<i8").tolist()
    hits = np.frombuffer(index[b"nodes.hits"], "<i8").tolist()
    prio = np.frombuffer(index[b"nodes.priority"], "<i4").tolist()
    has_sums = np.frombuffer(index[b"nodes.has_sums"], "u1").tolist()
    hb = index[b"blocks.hashes"]
    tb = index[b"blocks.tokens"]
    cols = [np.frombuffer(index[k], "<i4") for k in (b"blocks.device", b"blocks.host", b"blocks.disk")]
    cols = [col.tolist() if (col >= 0).any() else None for col in cols]  # a tier resident nowhere: no list
    sums = np.frombuffer(index[b"blocks.sums"], "<u8")
    sums = sums.tolist() if any(has_sums) else None
    # V16 (not S16: that would strip trailing zero bytes) turns into bytes objects in C
    hashes = np.frombuffer(hb, "V16").tolist()
    nodes: list[Node] = []
    counts = tree.num_blocks_in
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i, parent_ref in enumerate(parents):
            a, b = starts[i], starts[i + 1]
            parent = nodes[parent_ref] if parent_ref >= 0 else roots[-1 - parent_ref]
            toks = tb[a * block_bytes:b * block_bytes]
            slots = []
            for t, col in enumerate(cols):
                if col is None or col[a] < 0:
                    slots.append(None)
                else:
                    slots.append(col[a:b])
                    parent.kids_in[t] += 1
                    counts[t] += b - a
            node = Node(parent, toks[:block_bytes], toks, nblocks[i], hashes[a:b], slots, last[i])
            node.hit_count = hits[i]
            node.priority = prio[i]
            if has_sums[i]:
                node.checksums = sums[a:b]
            parent.children[node.key] = node
            nodes.append(node)
    finally:
        if enabled:
            gc.enable()
    return meta, nodes
