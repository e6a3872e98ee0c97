"""Checks of LMDB's data file before it is mapped: a walk of its pages, then a padding.

LMDB reads every page through a read-only mapping of ``data.mdb``. A file truncated behind its
back (a bad restore, a copy cut short, a filesystem repair) still has valid meta pages, but the
pages they point to lie past the end of the file, and the first read of one is a SIGBUS: the
daemon dies at startup with no message, and systemd restarts it into the same death. LMDB does
not compare the file with its pages, nor bound the sizes it reads, so ``check_structure`` walks
the file first (``prefixd.wal.pagewalk``, by ``pread``; its docstring lists what it checks).

The meta page layout read here is LMDB's on-disk data format 1 (``MDB_DATA_VERSION``, 0.9.x) on
a 64-bit little-endian host: a 16-byte page header, then ``MDB_meta``::

    offset 16   mm_magic   u32   0xBEEFC0DE
    offset 20   mm_version u32   1
    offset 32   mm_mapsize u64   the map size when this meta page was written
    offset 40   mm_dbs[0].md_pad u32   the page size (LMDB keeps it in the free DB's pad)
    offset 136  mm_last_pg u64   the last page in use
    offset 144  mm_txnid   u64   the transaction that wrote this meta page

Meta pages are pages 0 and 1; LMDB uses the one with the higher txnid. Anything that does not
parse as that layout (another format, an empty or new file) is left to LMDB to judge.

``pad_data_file`` then pads the file with ``TAIL_PAD`` zero bytes past its last page (a sparse
extension, no disk blocks). It came before the walk: LMDB bounds-checks page numbers but not
what it reads inside a page, so a flipped 16-bit node offset or key size in a page near the end
of the file made it read up to 64 KiB past the end (the bit-flip soak, 2 of 720 trials). The
walk now refuses those offsets; the padding stays as a second line.
"""

from __future__ import annotations

import os
import struct

from prefixd.wal import pagewalk
from prefixd.wal.errors import WalCorruptError

MAGIC = 0xBEEFC0DE
TAIL_PAD = 256 << 10  # > a 16-bit offset plus a 16-bit key size past the last page
DATA_VERSION = 1
_HEAD = struct.Struct("<II")  # mm_magic, mm_version at offset 16
_PSIZE = struct.Struct("<I")  # mm_dbs[FREE_DBI].md_pad at offset 40
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid at offset 136
_MAPSIZE = struct.Struct("<Q")  # mm_mapsize at offset 32
SHOWN_PROBLEMS = 3  # how many of the walk's findings an error names


def _meta(raw: bytes, offset: int) -> tuple[int, int, int] | None:
    """``(txnid, last_pg, page_size)`` of the meta page at ``offset``, or None if it is not one."""
    if len(raw) < offset + 152:
        return None
    magic, version = _HEAD.unpack_from(raw, offset + 16)
    if magic != MAGIC or version != DATA_VERSION:
        return None
    (psize,) = _PSIZE.unpack_from(raw, offset + 40)
    last_pg, txnid = _TAIL.unpack_from(raw, offset + 136)
    return txnid, last_pg, psize


def _metas(path: str) -> list[tuple[tuple[int, int, int], int]]:
    """``((txnid, last_pg, page_size), offset)`` of each meta page of the known layout in
    ``path``; empty when the file is absent or its first page is not one."""
    try:
        with open(path, "rb") as f:
            meta0 = _meta(f.read(152), 0)
            if meta0 is None:
                return []
            f.seek(meta0[2])
            meta1 = _meta(f.read(152), 0)
    except FileNotFoundError:
        return []
    return [(meta0, 0)] + ([(meta1, meta0[2])] if meta1 is not None else [])


def newest_meta(path: str) -> tuple[int, int, int] | None:
    """``(txnid, last_pg, page_size)`` of the meta page LMDB would use, or None when the file
    is absent or its first page is not an LMDB meta page of the known layout."""
    metas = _metas(path)
    return max(metas)[0] if metas else None


def pad_data_file(path: str) -> None:
    """Pad ``path`` (an LMDB ``data.mdb``, walked by ``check_structure`` first) with ``TAIL_PAD``
    zero bytes past its newest meta page's last page (the module docstring says why). The caller
    holds the state directory's lock: nothing else writes the file meanwhile.

    NOTE: no size check here: a sound file may end before its last page (pages LMDB allocated
    and freed in one transaction go to the free list unwritten: 5 of 60 random environments in
    ``tests/wal/test_datafile.py``). A truncation is found by the walk, which knows which pages
    a tree uses. The padding only ever extends: the zeros cover unwritten free pages too.
    """
    meta = newest_meta(path)
    if meta is None:
        return
    _, last_pg, psize = meta
    need = (last_pg + 1) * psize
    if os.path.getsize(path) < need + TAIL_PAD:
        try:
            os.truncate(path, need + TAIL_PAD)  # zeros, sparse; LMDB writes pages at their offsets
        except OSError:  # a read-only state directory: LMDB's open reports it
            pass


def meta_problems(path: str, meta: tuple[int, int, int], offset: int, max_map_size: int | None) -> list[str]:
    """What is wrong with the newest meta page's last page number, at ``offset`` of ``path``.

    LMDB allocates pages only inside its map and writes the map's size into each meta page it
    commits, so ``(mm_last_pg + 1) * page size <= mm_mapsize`` in every meta page it wrote; and
    the log never grows its map past ``max_map_size``. A flipped high bit of ``mm_last_pg``
    breaks both, and LMDB believes it: it maps that many bytes (a 64 TiB map in the bit-flip
    soak, past the log's 1 TiB ceiling), the padding would extend the file to match (a sparse
    file that large where the filesystem allows one), and the next commit writes its pages
    there. Not checked: ``mm_mapsize`` alone, which LMDB ignores when the opener names a map
    size (the log always does) and rewrites at the next commit."""
    _, last_pg, psize = meta
    with open(path, "rb") as f:
        f.seek(offset + 32)
        (mapsize,) = _MAPSIZE.unpack(f.read(8))
    need = (last_pg + 1) * psize
    problems = []
    if need > mapsize:
        problems.append(f"the newest meta page names page {last_pg} as its last, {need} bytes, past "
                        f"the {mapsize}-byte map it was written with")
    elif max_map_size is not None and need > max_map_size:
        problems.append(f"the newest meta page names page {last_pg} as its last, {need} bytes, past "
                        f"the log's largest map ({max_map_size} bytes)")
    return problems


def check_structure(path: str, state_dir: str, max_map_size: int | None = None) -> None:
    """Refuse ``path`` (an LMDB ``data.mdb``, not yet mapped) if a read through LMDB could leave
    the file, or its map could pass ``max_map_size``: ``meta_problems``, then ``pagewalk.walk``
    from the newest meta page. A file that is absent or not of the known layout is left to
    LMDB, as in ``pad_data_file``.

    Raises:
        WalCorruptError: the newest meta page's last page is out of bounds, or the walk found
            damage or could not finish (lsn -1: no record can be named), with the first findings.
    """
    metas = _metas(path)
    if not metas:
        return
    meta, offset = max(metas)
    try:
        problems = meta_problems(path, meta, offset, max_map_size) or pagewalk.walk(path, meta, offset)
    except Exception as exc:  # noqa: BLE001 - a walk that cannot finish vouches for nothing
        problems = [f"the walk stopped: {type(exc).__name__}: {exc}"]
    if problems:
        more = f" (and {len(problems) - SHOWN_PROBLEMS} more)" if len(problems) > SHOWN_PROBLEMS else ""
        raise WalCorruptError(
            -1, f"{path} fails the structural check: {'; '.join(problems[:SHOWN_PROBLEMS])}{more}", state_dir,
        )
