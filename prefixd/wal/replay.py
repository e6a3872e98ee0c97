"""Replay: the log after a given lsn, decoded and verified, in lsn order.

Guarantees (the package docstring states them for callers):

- Records come in strictly increasing, contiguous lsn order starting at
  ``max(after_lsn, checkpoint_lsn) + 1``; a gap is corruption (a group is one transaction and a
  failed group poisons the log, so committed lsns never skip).
- Every record's checksum, length and kind are verified; the first bad one raises
  :class:`WalCorruptError` with its lsn. There is no "torn tail" to tolerate: LMDB commits are
  atomic, so a crash loses whole groups, never part of a record.
- Records are read in batches of short read transactions, so replay never pins an old snapshot
  (LMDB cannot reuse pages a reader can see) and never blocks map growth for long.
"""

from __future__ import annotations

from collections.abc import Iterator

import lmdb

from prefixd.wal.codec import Record, decode, pack_key, unpack_key
from prefixd.wal.env import WalEnv
from prefixd.wal.errors import WalCorruptError
from prefixd.wal.meta import K_CHECKPOINT, get_u64

BATCH = 4096


def _read_batch(wenv: WalEnv, start_lsn: int, limit: int) -> tuple[int, list[tuple[bytes, bytes]]]:
    def fn(txn: lmdb.Transaction) -> tuple[int, list[tuple[bytes, bytes]]]:
        checkpoint_lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
        cursor = txn.cursor(db=wenv.log)
        rows: list[tuple[bytes, bytes]] = []
        if not cursor.set_range(pack_key(start_lsn)):
            return checkpoint_lsn, rows
        for row in cursor:
            rows.append(row)
            if len(rows) >= limit:
                break
        return checkpoint_lsn, rows

    return wenv.read(fn)


def replay(wenv: WalEnv, after_lsn: int = 0, batch: int = BATCH) -> Iterator[Record]:
    """Yield every record with lsn > ``after_lsn`` (and > the checkpoint lsn), verified.

    Raises:
        WalCorruptError: a bad record or a gap in the lsns (carries the lsn).
        ForkedEnvError: used in a forked child.
    """
    if after_lsn < 0:
        raise ValueError(f"after_lsn must be >= 0, got {after_lsn}")
    expect = None
    next_lsn = after_lsn + 1
    path = wenv.state_dir
    while True:
        checkpoint_lsn, rows = _read_batch(wenv, next_lsn, batch)
        if expect is None:
            expect = max(after_lsn, checkpoint_lsn) + 1
        for key, value in rows:
            lsn = unpack_key(key)
            if lsn != expect:
                raise WalCorruptError(expect, f"missing record: the next stored lsn is {lsn}", path)
            try:
                record = decode(lsn, value)
            except WalCorruptError as exc:
                raise WalCorruptError(lsn, exc.reason, path) from None
            expect += 1
            yield record
        if len(rows) < batch:
            return
        next_lsn = expect


def last_lsn(wenv: WalEnv) -> int:
    """The highest lsn in use: the last log key, else the checkpoint lsn, else 0."""

    def fn(txn: lmdb.Transaction) -> int:
        cursor = txn.cursor(db=wenv.log)
        checkpoint_lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
        if cursor.last():
            return max(unpack_key(cursor.key()), checkpoint_lsn)
        return checkpoint_lsn

    return wenv.read(fn)
