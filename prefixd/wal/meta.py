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
- ``epoch``: u64 BE, incremented at every open.
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
from prefixd.wal.errors import StateMismatchError
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
    raw = txn.get(key, db=db)
    return default if raw is None else _U64.unpack(raw)[0]


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
        StateMismatchError: format version, kinds or layouts differ from the saved ones, or meta
            is missing from an environment that holds data.
    """
    path = wenv.state_dir
    boot_id = read_boot_id()

    def txn_fn(txn: lmdb.Transaction) -> MetaInfo:
        db = wenv.meta
        raw_version = txn.get(K_FORMAT, db=db)
        created = raw_version is None
        if created:
            if txn.stat(wenv.log)["entries"] or txn.stat(wenv.index)["entries"]:
                raise StateMismatchError(path, "format_version", "no meta in an environment with data")
            put_u64(txn, db, K_FORMAT, FORMAT_VERSION)
            txn.put(K_SEED, os.urandom(ROOT_SEED_SIZE), db=db)
            put_u64(txn, db, K_CHECKPOINT, 0)
        else:
            saved = _U64.unpack(raw_version)[0]
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
                    f"bytes; the KV layouts changed: use a new state directory for them",
                )
        epoch = get_u64(txn, db, K_EPOCH) + 1
        put_u64(txn, db, K_EPOCH, epoch)
        previous_boot = txn.get(K_BOOT, db=db) or b""
        txn.put(K_BOOT, boot_id, db=db)
        return MetaInfo(
            FORMAT_VERSION, txn.get(K_SEED, db=db), saved_layouts, get_u64(txn, db, K_CHECKPOINT),
            epoch, boot_id, previous_boot, created,
        )

    info = wenv.write(txn_fn)
    log.info("wal opened path=%s epoch=%s checkpoint_lsn=%s created=%s",
             path, info.epoch, info.checkpoint_lsn, info.created)
    return info


def _check_kinds(path: str, raw: bytes | None) -> None:
    if raw is None:
        return
    ours = {row[0]: row for row in kinds_table()}
    for row in msgpack.unpackb(raw):
        mine = ours.get(row[0])
        if mine is None:
            raise StateMismatchError(
                path, "kinds", f"the log may hold kind {row[0]} ({row[1]}) that this build lacks "
                f"(written by a newer prefixd)",
            )
        if list(mine) != list(row):
            raise StateMismatchError(path, "kinds", f"kind {row[0]} saved as {row}, this build has {mine}")
