"""A bounds walk of LMDB's data file before it is mapped: no read through the map may leave the file.

LMDB checks a page number against the last page in use, but not against the file: a file cut
short (a bad restore, a copy cut short) still has valid meta pages, and the first read of a page
past its end is a SIGBUS. Nor does it bound what it reads inside a page or from a size:

- a node's 16-bit offset and a key's size (up to 64 KiB past a page);
- a value's 32-bit size. py-lmdb touches one byte of every page of a value as it hands the
  value out (its ``preload``), before any of our code sees it, so a size grown by a flipped bit
  is a SIGBUS inside ``iternext`` (the bit-flip soak, 1 of 5,280 trials);
- an overflow value's first page number and length, and the overflow page's own page count;
- the databases' flags, which LMDB takes from the file (a flipped duplicate-sort flag fails an
  assertion: a SIGABRT);
- the free list: a record's entry count (LMDB copies that many page numbers when it allocates),
  its page numbers (a page listed free but in use is overwritten under a tree that points at
  it), its txnid keys (LMDB asserts on their order: a SIGABRT).

``walk`` reads every page reachable from the newest meta page with ``pread`` (never the map), a
tree level at a time, and checks those bounds, that every page a tree uses is in the file (a
sound file may end before the last page: pages allocated and freed in one transaction go to the
free list unwritten), page kinds, page numbers (each page stores its own), cycles and depth,
with numpy over all of a level's node headers at once; then the free list against the pages the
trees use (``_Walk.finish``). It checks no key order (but the free list's) and no counters: a
damaged order or count makes LMDB or the records' checksums refuse the file, typed; a read past
the file or one of LMDB's assertions kills the process.

``lmdb.verify`` (py-lmdb's full offline verifier) checks all of that too, but takes several
times as long on a large state, too long for every start; ``prefixctl verify`` runs it,
offline (docs/design.md, "Write-ahead log").

Layout (LMDB data format 1, a 64-bit little-endian build): a page is a 16-byte header
(``mp_pgno`` u64, ``mp_pad`` u16, ``mp_flags`` u16, then ``mp_lower`` / ``mp_upper`` u16, or for
an overflow page ``mp_pages`` u32), then ``mp_ptrs`` (u16 node offsets). A node is ``mn_lo``,
``mn_hi``, ``mn_flags``, ``mn_ksize`` (u16 each), the key, then the value: ``mn_lo | mn_hi << 16``
is a leaf's value size, and with ``mn_flags`` a branch's child page number (48 bits). A big
value's node holds the u64 page number of its overflow pages. A named database's record in the
main tree is an ``MDB_db`` (48 bytes, ``md_root`` at 40); the meta page holds the free and
main databases' at offsets 40 and 88 of the page.
"""

from __future__ import annotations

import os
import struct

import numpy as np

P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
P_LEAF2, P_SUBP = 0x20, 0x40  # pages of duplicate-sort databases, which prefixd does not use
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = (1 << 64) - 1  # the root of an empty tree
PAGE_HEADER = 16
NODE_HEADER = 8
DB_RECORD = 48  # sizeof(MDB_db)
ROOT_IN_DB = 40  # md_root's offset in an MDB_db
FLAGS_IN_DB = 4  # md_flags' offset in an MDB_db (u16)
# the flags LMDB writes for the free DB (MDB_INTEGERKEY), the main DB and prefixd's named DBs:
# LMDB takes them from the file, and a flipped MDB_DUPSORT fails an assertion (a SIGABRT)
FREE_DB_FLAGS, MAIN_DB_FLAGS, NAMED_DB_FLAGS = 0x08, 0x00, 0x00
FREE_DB_AT, MAIN_DB_AT = 40, 88  # mm_dbs[FREE_DBI], mm_dbs[MAIN_DBI] in a meta page
MAX_DEPTH = 32  # LMDB's CURSOR_STACK: a deeper tree is damage
MAX_PROBLEMS = 20
LEVEL_CHUNK = 4096  # pages read and checked in one numpy pass: bounds its memory on a large log
_U64 = struct.Struct("<Q")
_OVERFLOW = struct.Struct("<QHHI")  # mp_pgno, mp_pad, mp_flags, mp_pages


def _u16(flat: np.ndarray, at: np.ndarray) -> np.ndarray:
    return flat[at].astype(np.int64) | flat[at + 1].astype(np.int64) << 8


def _u64(flat: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Little-endian u64s at byte offsets ``at`` of ``flat`` (as Python-safe int64 when < 2^63;
    larger values, only ever damage, come out negative and fail every range check)."""
    out = np.zeros(len(at), dtype=np.uint64)
    for k in range(8):
        out |= flat[at + k].astype(np.uint64) << np.uint64(8 * k)
    return out.view(np.int64)


class _Walk:
    """One walk's file, bounds and findings (``walk`` is the entry point).

    NOTE: the walk is level by level, each level's pages read into one array and checked with
    numpy over all their nodes at once: a checkpoint of 1M blocks is ~2,000 leaf pages of ~45,000
    nodes, and page-at-a-time numpy cost ~120 us a page here, as much as LMDB's open and the
    checkpoint's load together.
    """

    def __init__(self, fd: int, psize: int, txnid: int, next_pgno: int, file_size: int,
                 path: str = "data.mdb") -> None:
        self.fd, self.psize, self.txnid, self.path = fd, psize, txnid, path
        self.next_pgno = next_pgno  # pages [2, next_pgno) are in a tree or free
        # NOTE: a sound file may end before next_pgno: pages LMDB allocated and freed in one
        # transaction go to the free list unwritten. Only pages a tree uses must be in the file.
        self.file_size, self.file_pages = file_size, file_size // psize
        self.problems: list[str] = []
        self.seen: set[int] = set()  # tree pages reached
        self.overflows: list[tuple[int, int]] = []  # (first page, pages) of every big value
        self.free: list[tuple[int, bytes]] = []  # (txnid, page-number list) of the free DB, in key order

    def bad(self, where: str, what: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{where}: {what}")

    def in_range(self, pgno: int, npages: int = 1) -> bool:
        return 2 <= pgno and pgno + npages <= self.next_pgno

    def in_file(self, where: str, pgno: int, npages: int = 1) -> bool:
        """True when pages [pgno, +npages) are in the file; else a finding (a truncated file)."""
        if pgno + npages <= self.file_pages:
            return True
        self.bad(where, f"{self.path} is {self.file_size} bytes, but pages [{pgno}, +{npages}) of "
                        f"{self.psize} bytes are in use past its end: the file was truncated; restore it "
                        f"or move the state directory away")
        return False

    def tree(self, name: str, root: int, is_free: bool = False) -> None:
        """Walk one B-tree from ``root``, a level at a time."""
        level, depth = ([] if root == P_INVALID else [root]), 0
        while level and not self.problems:
            depth += 1
            if depth > MAX_DEPTH:
                self.bad(f"{name} DB", f"deeper than {MAX_DEPTH} levels")
                return
            pgnos = []
            for pgno in level:
                if not self.in_range(pgno):
                    self.bad(f"{name} DB page {pgno}", f"out of range (pages in use: {self.next_pgno})")
                elif pgno in self.seen:
                    self.bad(f"{name} DB page {pgno}", "reached twice (a cycle or a shared page)")
                elif self.in_file(f"{name} DB page {pgno}", pgno):
                    self.seen.add(pgno)
                    pgnos.append(pgno)
            if self.problems:
                return
            level = []
            for i in range(0, len(pgnos), LEVEL_CHUNK):  # in key order: the free list's keys stay sorted
                level += self.level(name, pgnos[i:i + LEVEL_CHUNK], is_free)

    def level(self, name: str, pgnos: list[int], is_free: bool) -> list[int]:
        """Check one level's pages; returns the next level's page numbers."""
        psize = self.psize
        flat = np.frombuffer(b"".join(os.pread(self.fd, psize, p * psize) for p in pgnos), np.uint8)
        base = np.arange(len(pgnos), dtype=np.int64) * psize
        stored = _u64(flat, base)
        flags, lower, upper = _u16(flat, base + 10), _u16(flat, base + 12), _u16(flat, base + 14)
        kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_LEAF2 | P_SUBP)
        ok = ((stored == np.asarray(pgnos, dtype=np.int64)) & ((kind == P_BRANCH) | (kind == P_LEAF))
              & (PAGE_HEADER <= lower) & (lower <= upper) & (upper <= psize) & ((lower - PAGE_HEADER) % 2 == 0))
        for i in np.flatnonzero(~ok)[:MAX_PROBLEMS]:
            self.bad(f"{name} DB page {pgnos[i]}", f"bad header (page number {int(stored[i])}, flags "
                                                    f"{int(flags[i]):#x}, lower {int(lower[i])}, upper {int(upper[i])})")
        if not ok.all():
            return []
        # every node of the level: its page, its offset, its 8-byte header
        counts = (lower - PAGE_HEADER) // 2
        page = np.repeat(np.arange(len(pgnos)), counts)
        nth = np.arange(len(page)) - np.repeat(np.cumsum(counts) - counts, counts)
        offset = _u16(flat, base[page] + PAGE_HEADER + 2 * nth)
        outside = (offset < upper[page]) | (offset > psize - NODE_HEADER)
        if outside.any():
            return self._first(name, pgnos, page, outside, "a node offset outside the page's node area")
        at = base[page] + offset
        lo, hi, nflags, ksize = (_u16(flat, at + 2 * k) for k in range(4))
        data_at = offset + NODE_HEADER + ksize
        if (data_at > psize).any():
            return self._first(name, pgnos, page, data_at > psize, "a key runs past the page")
        branch = kind[page] == P_BRANCH
        children = (lo | hi << 16 | nflags << 32)[branch]
        leaf = ~branch
        size = lo | hi << 16
        big = leaf & (nflags & F_BIGDATA != 0)
        past = leaf & (data_at + np.where(big, 8, size) > psize)
        if past.any():
            return self._first(name, pgnos, page, past, "a value runs past the page")
        if (leaf & (nflags & F_DUPDATA != 0)).any():
            return self._first(name, pgnos, page, leaf & (nflags & F_DUPDATA != 0),
                               "a duplicate-sort node (prefixd's databases have none)")
        if is_free and (leaf & (ksize != 8)).any():
            return self._first(name, pgnos, page, leaf & (ksize != 8), "a free-list key is not a txnid")
        where_big = np.flatnonzero(big)
        values = {}
        for i, ov in zip(where_big, _u64(flat, base[page][where_big] + data_at[where_big])):
            values[i] = self.overflow(f"{name} DB page {pgnos[page[i]]}", int(ov), int(size[i]), is_free)
        if is_free:  # keep each record (txnid -> its page numbers) for finish()
            for i in np.flatnonzero(leaf):
                at = int(base[page[i]] + data_at[i])
                txnid = _U64.unpack_from(flat, at - 8)[0]
                value = values.get(i) if big[i] else bytes(flat[at:at + int(size[i])])
                if value is not None:
                    self.free.append((txnid, value))
        for i in np.flatnonzero(leaf & (nflags & F_SUBDATA != 0)):
            start = int(base[page[i]] + data_at[i])
            key = bytes(flat[start - int(ksize[i]):start]).decode("ascii", "replace")
            if big[i] or int(size[i]) != DB_RECORD:
                self.bad(f"{name} DB page {pgnos[page[i]]}", f"the record of database {key!r} is {int(size[i])} bytes")
            elif (flags := int(_u16(flat, np.array([start + FLAGS_IN_DB]))[0])) != NAMED_DB_FLAGS:
                self.bad(f"{name} DB page {pgnos[page[i]]}", f"database {key!r} has flags {flags:#x}, "
                                                             f"not {NAMED_DB_FLAGS:#x}")
            else:
                self.tree(f"{name}/{key}", _U64.unpack_from(flat, start + ROOT_IN_DB)[0])
        return [int(c) for c in children]

    def _first(self, name: str, pgnos: list[int], page: np.ndarray, mask: np.ndarray, what: str) -> list[int]:
        self.bad(f"{name} DB page {pgnos[page[np.flatnonzero(mask)[0]]]}", what)
        return []

    def overflow(self, where: str, pgno: int, size: int, is_free: bool) -> bytes | None:
        """Check a big value's overflow pages; returns the value of a free-list record."""
        npages = -(-(PAGE_HEADER + size) // self.psize)
        if not self.in_range(pgno, npages):
            self.bad(where, f"a value of {size} bytes on pages [{pgno}, +{npages}) past the pages in use "
                            f"({self.next_pgno})")
            return None
        if not self.in_file(where, pgno, npages):
            return None
        stored, _, flags, pages = _OVERFLOW.unpack_from(os.pread(self.fd, _OVERFLOW.size, pgno * self.psize))
        if stored != pgno or not flags & P_OVERFLOW or pages < npages:
            self.bad(where, f"overflow page {pgno} (page number {stored}, flags {flags:#x}, {pages} pages) "
                            f"does not hold a value of {size} bytes")
            return None
        self.overflows.append((pgno, npages))
        return os.pread(self.fd, size, pgno * self.psize + PAGE_HEADER) if is_free else None

    def finish(self) -> None:
        """The free list against the trees. LMDB trusts it when it allocates (the open's own
        write transaction does): a page listed free but in use is overwritten while a tree
        still points at it, and a txnid past the meta's or out of order fails an assertion in
        ``mdb_freelist_save`` (the bit-flip soak: a SIGABRT)."""
        if self.problems:
            return
        live = np.zeros(self.next_pgno, dtype=bool)
        live[list(self.seen)] = True
        for first, n in self.overflows:
            if live[first:first + n].any():
                self.bad(f"overflow pages [{first}, +{n})", "also in use elsewhere")
                return
            live[first:first + n] = True
        last_txnid, lists = 0, []
        for txnid, value in self.free:
            where = f"free DB record of txn {txnid}"
            if not last_txnid < txnid <= self.txnid:
                self.bad(where, f"out of order or past the meta's txn {self.txnid}")
                return
            last_txnid = txnid
            if len(value) < 8 or len(value) % 8 or _U64.unpack_from(value)[0] != len(value) // 8 - 1:
                self.bad(where, f"{len(value)} bytes do not hold the count they start with")
                return
            pages = np.frombuffer(value, "<u8", offset=8).view(np.int64)
            if pages.size and ((pages < 2).any() or (pages >= self.next_pgno).any() or (np.diff(pages) >= 0).any()):
                self.bad(where, f"page numbers out of range or not descending (pages in use: {self.next_pgno})")
                return
            lists.append(pages)
        free = np.concatenate(lists) if lists else np.zeros(0, dtype=np.int64)
        if np.unique(free).size != free.size:
            self.bad("free DB", "a page listed free twice")
        elif live[free].any():
            self.bad("free DB", f"page {int(free[live[free]][0])} listed free but in use")


def walk(path: str, txnid_last_pg_psize: tuple[int, int, int], meta_offset: int) -> list[str]:
    """Findings of the bounds walk of ``path`` (empty: every read LMDB can make stays in the file).

    ``txnid_last_pg_psize`` is the newest meta page's (``datafile.newest_meta``), found at
    ``meta_offset`` in the file.
    """
    txnid, last_pg, psize = txnid_last_pg_psize
    fd = os.open(path, os.O_RDONLY)
    try:
        w = _Walk(fd, psize, txnid, last_pg + 1, os.fstat(fd).st_size, path)
        meta = os.pread(fd, MAIN_DB_AT + DB_RECORD, meta_offset)
        for what, at, want in (("free", FREE_DB_AT, FREE_DB_FLAGS), ("main", MAIN_DB_AT, MAIN_DB_FLAGS)):
            (got,) = struct.unpack_from("<H", meta, at + FLAGS_IN_DB)
            if got != want:
                w.bad(f"the meta page at {meta_offset}", f"the {what} DB has flags {got:#x}, not {want:#x}")
        if w.problems:
            return w.problems
        w.tree("free", _U64.unpack_from(meta, FREE_DB_AT + ROOT_IN_DB)[0], is_free=True)
        w.tree("main", _U64.unpack_from(meta, MAIN_DB_AT + ROOT_IN_DB)[0])
        w.finish()
        return w.problems
    finally:
        os.close(fd)
