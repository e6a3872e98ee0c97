"""A check of LMDB's data file before it is mapped: refuse a file shorter than it says it is.

LMDB reads every page through a read-only mapping of ``data.mdb``. A file truncated behind its
back (a bad restore, a copy cut short, a filesystem repair) still has valid meta pages, but the
pages they point to lie past the end of the file, and the first read of one is a SIGBUS: the
daemon dies at startup with no message, and systemd restarts it into the same death. LMDB does
not compare the file size with its meta pages, so this module does, before ``lmdb.open``.

The meta page layout read here is LMDB's on-disk data format 1 (``MDB_DATA_VERSION``, 0.9.x) on
a 64-bit little-endian host: a 16-byte page header, then ``MDB_meta``::

    offset 16   mm_magic   u32   0xBEEFC0DE
    offset 20   mm_version u32   1
    offset 40   mm_dbs[0].md_pad u32   the page size (LMDB keeps it in the free DB's pad)
    offset 136  mm_last_pg u64   the last page in use
    offset 144  mm_txnid   u64   the transaction that wrote this meta page

Meta pages are pages 0 and 1; LMDB uses the one with the higher txnid. Anything that does not
parse as that layout (another format, an empty or new file) is left to LMDB to judge.
"""

from __future__ import annotations

import os
import struct

from prefixd.wal.errors import WalCorruptError

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
_HEAD = struct.Struct("<II")  # mm_magic, mm_version at offset 16
_PSIZE = struct.Struct("<I")  # mm_dbs[FREE_DBI].md_pad at offset 40
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid at offset 136


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


def check_data_file(path: str, state_dir: str) -> None:
    """Refuse ``path`` (an LMDB ``data.mdb``) if it is shorter than its newest meta page says.

    Raises:
        WalCorruptError: the file is truncated (lsn 0: no record could be read), with its size
            and the size its meta page needs.
    """
    try:
        with open(path, "rb") as f:
            first = f.read(152)
            meta0 = _meta(first, 0)
            if meta0 is None:
                return
            f.seek(meta0[2])
            meta1 = _meta(f.read(152), 0)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return
    metas = [m for m in (meta0, meta1) if m is not None]
    txnid, last_pg, psize = max(metas)
    need = (last_pg + 1) * psize
    if size < need:
        raise WalCorruptError(
            0, f"{path} is {size} bytes, but its meta page (txn {txnid}) uses pages up to {last_pg} "
            f"of {psize} bytes ({need} bytes): the file was truncated; restore it or move the state "
            f"directory away", state_dir,
        )
