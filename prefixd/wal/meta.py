"""The ``meta`` database: identity and compatibility of a state directory.

Keys (ASCII) and values:

- ``format_version``: u64 BE. The envelope format (key encoding, record framing, checkpoint
  chunking). A different saved version is refused.
- ``kinds``: msgpack ``[[code, name, field formats, has_blob], ...]``. A saved kind whose row
  differs from this build's, or that this build lacks (a downgrade), is refused; kinds this build
  adds are accepted and the saved table is updated.
- ``root_seed``: 16 random bytes, created once; the root of every block hash chain.
- ``layouts``: opaque bytes given by the caller (the KV layouts); a difference is refused.
- ``checkpoint_lsn``: u64 BE, the lsn the checkpoint in ``index``/``seqs`` folds (0 = none).
- ``epoch``: u64 BE, incremented at every open; at most ``MAX_EPOCH`` (records carry it as a
  u32: a larger one is damage, refused as such).
- ``boot_id``: the kernel boot id (``/proc/sys/kernel/random/boot_id``) at the last open.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import NamedTuple

import lmdb
import msgpack

from prefixd.wal.env import WalEnv
from prefixd.wal.errors import StateMismatchError, WalCorruptError
from prefixd.wal.kinds import kinds_table

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROOT_SEED_SIZE = 16
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

K_FORMAT = b"format_version"
K_KINDS = b"kinds"
K_SEED = b"root_seed"
K_LAYOUTS = b"layouts"
K_CHECKPOINT = b"checkpoint_lsn"
K_EPOCH = b"epoch"
MAX_EPOCH = (1 << 32) - 1  # the ATTACH and RECOVER records' u32 field
K_BOOT = b"boot_id"

_U64 = struct.Struct(">Q")


class MetaInfo(NamedTuple):
    """What ``open_meta`` found and wrote. ``previous_boot_id`` is the boot id of the previous
    open (``b""`` on a new state directory): equal to ``boot_id`` iff the host did not reboot, so
    shm-resident data may have survived."""

    format_version: int
    root_seed: bytes
    layouts: bytes | None
    checkpoint_lsn: int
    epoch: int
    boot_id: bytes
    previous_boot_id: bytes
    created: bool


def read_boot_id() -> bytes:
    """The kernel boot id, or ``b""`` where the kernel does not expose one."""
    try:
        with open(BOOT_ID_PATH, "rb") as f:
            return f.read().strip()
    except OSError:
        log.warning("no kernel boot id path=%s; shm residency will not be trusted", BOOT_ID_PATH)
        return b""


def get_u64(txn: lmdb.Transaction, db, key: bytes, default: int = 0) -> int:
    """A u64 meta entry (``default`` when absent).

    Raises:
        WalCorruptError: the stored value is not 8 bytes (meta values carry no checksum: its
            length is what can be checked).
    """
    raw = txn.get(key, db=db)
    if raw is None:
        return default
    if len(raw) != _U64.size:
        raise WalCorruptError(-1, f"meta entry {bytes(key)!r} is {len(raw)} bytes, not {_U64.size}")
    return _U64.unpack(raw)[0]


def put_u64(txn: lmdb.Transaction, db, key: bytes, value: int) -> None:
    txn.put(key, _U64.pack(value), db=db)


def open_meta(wenv: WalEnv, layouts: bytes | None) -> MetaInfo:
    """Validate (or initialize) meta, bump the epoch and record the boot id, in one write txn.

    Args:
        wenv: the open environment.
        layouts: the caller's layouts; None accepts whatever is saved (offline tools).

    Returns:
        MetaInfo for this open.

    Raises:
        StateMismatchError: format version, kinds or layouts differ from the saved ones.
        WalCorruptError: meta is missing from an environment that holds data, or an entry does
            not decode.
    """
    path = wenv.state_dir
    boot_id = read_boot_id()

    def txn_fn(txn: lmdb.Transaction) -> MetaInfo:
        db = wenv.meta
        raw_version = txn.get(K_FORMAT, db=db)
        created = raw_version is None
        if created:
            if txn.stat(wenv.log)["entries"] or txn.stat(wenv.index)["entries"]:
                raise WalCorruptError(-1, "the meta database is empty in an environment that holds "
                                      "records (damaged, or emptied by hand)", path)
            put_u64(txn, db, K_FORMAT, FORMAT_VERSION)
            txn.put(K_SEED, os.urandom(ROOT_SEED_SIZE), db=db)
            put_u64(txn, db, K_CHECKPOINT, 0)
        else:
            saved = get_u64(txn, db, K_FORMAT)
            if saved != FORMAT_VERSION:
                raise StateMismatchError(
                    path, "format_version",
                    f"saved {saved}, this build writes {FORMAT_VERSION}; use a prefixd of the same "
                    f"format or move the state directory away",
                )
        _check_kinds(path, txn.get(K_KINDS, db=db))
        txn.put(K_KINDS, msgpack.packb(kinds_table()), db=db)
        saved_layouts = txn.get(K_LAYOUTS, db=db)
        if layouts is not None:
            if saved_layouts is None:
                txn.put(K_LAYOUTS, layouts, db=db)
                saved_layouts = layouts
            elif saved_layouts != layouts:
                raise StateMismatchError(
                    path, "layouts",
                    f"saved {len(saved_layouts)} bytes differ from the configured {len(layouts)} "
                    f"bytes; the KV layouts changed: use a new state directory for them, or move "
                    f"this one away",
                )
        epoch = get_u64(txn, db, K_EPOCH) + 1
        if epoch > MAX_EPOCH:  # one per open: 2**32 opens never happen, a flipped bit does
            raise WalCorruptError(-1, f"meta epoch {epoch - 1} is past the {MAX_EPOCH} that log "
                                  f"records carry: the meta database is damaged", path)
        put_u64(txn, db, K_EPOCH, epoch)
        previous_boot = txn.get(K_BOOT, db=db) or b""
        txn.put(K_BOOT, boot_id, db=db)
        seed = txn.get(K_SEED, db=db)
        if seed is None or len(seed) != ROOT_SEED_SIZE:
            raise WalCorruptError(-1, f"meta root seed is {'absent' if seed is None else len(seed)} "
                                  f"bytes, not {ROOT_SEED_SIZE}", path)
        return MetaInfo(
            FORMAT_VERSION, seed, saved_layouts, get_u64(txn, db, K_CHECKPOINT),
            epoch, boot_id, previous_boot, created,
        )

    try:
        info = wenv.write(txn_fn)
    except WalCorruptError as exc:
        if exc.path is not None:
            raise
        raise WalCorruptError(exc.lsn, exc.reason, path) from exc  # name the directory
    except lmdb.Error as exc:
        # LMDB answers EIO for a short write of its pages: at open, found by the bit-flip soak
        # (a damaged free list gave the commit pages it could not write). A disk that fails
        # reads the same; either way this state cannot be opened as it is.
        if "Input/output error" not in str(exc):
            raise
        raise WalCorruptError(-1, f"LMDB could not write data.mdb at open ({exc}): the file is "
                              f"damaged or its disk failed; check the disk, then restore the "
                              f"file or move the state directory away", path) from exc
    log.info("wal opened path=%s epoch=%s checkpoint_lsn=%s created=%s",
             path, info.epoch, info.checkpoint_lsn, info.created)
    return info


def _check_kinds(path: str, raw: bytes | None) -> None:
    if raw is None:
        return
    ours = {row[0]: row for row in kinds_table()}
    try:
        rows = msgpack.unpackb(raw)
        rows = [list(row) for row in rows]
        codes = [(row[0], row[1]) for row in rows]
    except (ValueError, TypeError, IndexError) as exc:  # msgpack's errors are ValueErrors
        raise WalCorruptError(-1, f"the saved kinds table does not decode: {exc!r}", path) from exc
    for row, (code, name) in zip(rows, codes):
        mine = ours.get(code)
        if mine is None:
            raise StateMismatchError(
                path, "kinds", f"the log may hold kind {code} ({name}) that this build lacks "
                f"(written by a newer prefixd): start that prefixd, or move the state directory away",
            )
        if list(mine) != list(row):
            raise StateMismatchError(path, "kinds", f"kind {code} saved as {row}, this build has {mine}: "
                                     f"start the prefixd that wrote it, or move the state directory away")
