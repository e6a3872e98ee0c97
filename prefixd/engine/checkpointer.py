"""A checkpoint in two parts: a picture of the state taken on the engine's thread, and its
bytes made from the picture on any thread.

``Picture.take`` finishes a walk of the index (``prefixd.engine.picture_walk``: in slices
across the loop's turns, or all at once) that keeps, per node, references to what the
checkpoint stores (its tokens, its hashes and checksums, packed or as lists, its host and disk
slot lists) and the node's numbers; then the live and recovered sequences and the meta. It
copies no per-block data. ``Picture.values`` then makes exactly the values
``checkpoint.dump_engine`` makes for that state (``index``, ``seqs``), touching nothing but the
picture, so the engine serves on meanwhile.

Why the references stay right while the engine changes the tree: a node's ``tokens``,
``hashes``, ``checksums`` and per-tier slot lists are replaced, never changed in place (a
split, a move, a drop or a verify assigns a new object: ``cache.node.split``,
``cache.tiering``; ``checkpoint.PlacedSlots`` relies on the same), and the numbers are copied.
The picture holds the old objects alive until its values are made.

NOTE: for a million blocks in some ten thousand runs, making the values and the LMDB write
each take up to seconds, waiting for the disk barrier next to nothing; the picture is the
per-node part of the walk. The values are made in steps that each hold the GIL briefly (a
copy of one run, a conversion of at most ``_STEP`` items), so that a thread making them
gives the GIL back to the event loop within the interpreter's switch interval (5 ms): one
``b"".join`` of 64 MB of tokens holds it for tens of milliseconds.
"""

from __future__ import annotations

from array import array
import sys
from typing import NamedTuple

import msgpack
import numpy as np

from prefixd.engine.checkpoint import engine_meta, engine_seqs
from prefixd.engine.picture_walk import (DISK, HASHES, HITS, HOST, LAST_ACCESS, NUM_BLOCKS, ON_DEVICE, PARENT,
                                         PRIORITY, SUMS, TOKENS, PictureWalk)
from prefixd.engine.records import RECORDS_VERSION
from prefixd.wal.checkpoint_store import CHUNK_SIZE

_STEP = 1 << 15  # items per numpy conversion: ~0.3 ms each, the GIL held that long at most
_SWAP = sys.byteorder != "little"


class Picture(NamedTuple):
    """The state a checkpoint at ``lsn`` stores, by reference; ``values()`` makes its bytes.

    ``since_records`` and ``tail_blocks`` are the engine's counts since the previous
    checkpoint when the picture was taken: what this checkpoint folds (the records after it
    count towards the next one)."""

    lsn: int
    nodes: dict  # node -> ``picture_walk.record``, parents reached before their children
    roots: list  # ``[(extra, root node), ...]``
    meta: dict
    seqs: list
    since_records: int
    tail_blocks: int

    @classmethod
    def take(cls, cache, sessions: dict, recovered, file_ids: dict, lsn: int,
             since_records: int = 0, tail_blocks: int = 0, walk: PictureWalk | None = None) -> "Picture":
        """The picture of ``cache`` now (on the engine's thread; the arguments are those of
        ``checkpoint.dump_engine``, and ``lsn`` the last record the state includes). ``walk``:
        the ``PictureWalk`` of ``cache.tree`` stepped to its end (else it is walked here)."""
        if walk is None:
            walk = PictureWalk(cache.tree, marks=False)
            walk.step(float("inf"))
        try:
            roots = walk.finish()
        finally:
            walk.close()
        meta = {"block_size": cache.block_size, "clock": cache.tree.clock,
                "records_version": RECORDS_VERSION, **engine_meta(cache, file_ids)}
        return cls(lsn, walk.records, roots, meta, engine_seqs(cache, sessions, recovered),
                   since_records, tail_blocks)

    def ordered(self) -> list[tuple]:
        """The records in tree order (parents first, children in their parent's order when
        reached), each with ``PARENT`` made the parent's index or ``-1 - r`` for root ``r``.

        NOTE: a node recorded again by ``PictureWalk.finish`` keeps its place in ``nodes``
        and one added while the walk was open comes last, after nodes it may be the parent
        of (a split's head): the order is made here, from the parent links, off the loop."""
        records = self.nodes
        kids: dict[int, list] = {id(root): [] for _, root in self.roots}
        for node, rec in records.items():
            kids.setdefault(id(rec[PARENT]), []).append(node)
        out: list[tuple] = []
        for r, (_, root) in enumerate(self.roots):
            stack = [(child, -1 - r) for child in reversed(kids[id(root)])]
            while stack:
                node, parent = stack.pop()
                me = len(out)
                out.append((parent, *records[node][1:]))
                below = kids.get(id(node))
                if below:
                    stack.extend([(child, me) for child in reversed(below)])
        if len(out) != len(records):
            raise ValueError(f"checkpoint picture reaches {len(out)} of its {len(records)} runs "
                             f"from the roots")
        return out

    def values(self) -> tuple[dict[bytes, object], dict[bytes, bytes]]:
        """``(index, seqs)`` for ``Wal.submit_checkpoint``: the bytes ``checkpoint.dump_engine``
        makes of the pictured state (on any thread; see the module's NOTE), the large values
        given as their list of ``CHUNK_SIZE`` chunks."""
        nodes = self.ordered()
        num_blocks = sum(n[NUM_BLOCKS] for n in nodes)
        tokens = _Pieces(sum(len(n[TOKENS]) for n in nodes))
        hashes = _Pieces(16 * num_blocks)
        sums = _Pieces(8 * sum(n[NUM_BLOCKS] for n in nodes if n[SUMS] is not None))
        host = np.empty(sum(n[NUM_BLOCKS] for n in nodes if n[HOST] is not None), "<u4")
        disk = np.empty(sum(n[NUM_BLOCKS] for n in nodes if n[DISK] is not None), "<u4")
        at_host = at_disk = 0
        flags = []
        for n in nodes:
            tokens.put(n[TOKENS])
            h = n[HASHES]
            hashes.put(h if isinstance(h, (bytes, bytearray)) else b"".join(h))
            s = n[SUMS]
            if s is not None:
                sums.put(s if isinstance(s, (bytes, bytearray)) else _packed_sums(s))
            on_host, on_disk = n[HOST], n[DISK]
            if on_host is not None:
                host[at_host:at_host + len(on_host)] = on_host
                at_host += len(on_host)
            if on_disk is not None:
                disk[at_disk:at_disk + len(on_disk)] = on_disk
                at_disk += len(on_disk)
            flags.append(n[ON_DEVICE] | (on_host is not None) << 1 | (on_disk is not None) << 2
                         | (s is not None) << 3)
        index = {
            b"nodes.parent": _column([n[PARENT] for n in nodes], "<i4"),
            b"nodes.blocks": _column([n[NUM_BLOCKS] for n in nodes], "<i4"),
            b"nodes.last_access": _column([n[LAST_ACCESS] for n in nodes], "<i8"),
            b"nodes.hits": _column([n[HITS] for n in nodes], "<i8"),
            b"nodes.priority": _column([n[PRIORITY] for n in nodes], "<i4"),
            b"nodes.flags": _column(flags, "u1"),
            b"blocks.hashes": hashes.done(),
            b"blocks.tokens": tokens.done(),
            b"blocks.host": _pieces_of(host),
            b"blocks.disk": _pieces_of(disk),
            b"blocks.sums": sums.done(),
            b"roots": msgpack.packb([[extra, root.hashes[-1]] for extra, root in self.roots]),
            b"meta": msgpack.packb(self.meta),
        }
        return index, {b"seqs": msgpack.packb(self.seqs)}


class _Pieces:
    """A value of a known size made piece by piece into ``CHUNK_SIZE`` bytearrays (the WAL's
    checkpoint chunks, ``prefixd.wal.checkpoint_store``): each copy and each new chunk's zeroing
    and page faults are short, where one bytearray of the whole value (64 MB of tokens at
    1M blocks) held the GIL for ~0.1 s to zero it."""

    __slots__ = ("size", "chunks", "at")

    def __init__(self, size: int) -> None:
        self.size = size
        self.chunks: list[bytearray] = []
        self.at = 0  # bytes put so far

    def put(self, piece) -> None:
        view = memoryview(piece).cast("B")
        while len(view):
            used = self.at % CHUNK_SIZE
            if not used:
                self.chunks.append(bytearray(min(CHUNK_SIZE, self.size - self.at)))
            take = min(len(view), CHUNK_SIZE - used)
            self.chunks[-1][used:used + take] = view[:take]
            view = view[take:]
            self.at += take

    def done(self) -> list[bytearray]:
        if self.at != self.size:
            raise ValueError(f"checkpoint column filled {self.at} of {self.size} bytes: a "
                             f"node changed size while pictured")
        return self.chunks or [bytearray()]


def _pieces_of(arr: np.ndarray) -> list[memoryview]:
    """A numpy column as ``CHUNK_SIZE`` views of its bytes (no copy)."""
    data = memoryview(arr).cast("B")
    return [data[a:a + CHUNK_SIZE] for a in range(0, len(data), CHUNK_SIZE)] or [data]


def _column(items: list, dtype: str) -> bytes:
    """``np.asarray(items, dtype).tobytes()``, converted ``_STEP`` items at a time."""
    out = np.empty(len(items), dtype)
    for a in range(0, len(items), _STEP):
        out[a:a + _STEP] = items[a:a + _STEP]
    return out.tobytes()


def _packed_sums(sums: list) -> bytes:
    """Checksums as ``packed_node.packed_checksums`` stores them (u64 little-endian)."""
    packed = array("Q", sums)
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()
