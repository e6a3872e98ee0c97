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
from itertools import islice

import google_crc32c
import lmdb

from prefixd.wal.codec import CRC_SIZE, Record, decode, pack_key, unpack_key
from prefixd.wal.records import CODECS
from prefixd.wal.env import WalEnv
from prefixd.wal.errors import WalCorruptError
from prefixd.wal.meta import K_CHECKPOINT, get_u64

BATCH = 4096

# crc32c over a value *including* its stored little-endian crc32c is this constant exactly when
# the stored crc matches (the map x -> crc(body || x) is a bijection): one C call per record, no
# slice of the body and no unpack of the stored value.
CRC32C_RESIDUE = 0x48674BC7
_crc32c = google_crc32c.value
_new_record = tuple.__new__
# per kind code: (kind, fields struct unpack_from, fixed size, has blob), None if unknown
_FAST = [None if c is None else (c.kind, c.struct.unpack_from, c.fixed_size, c.spec.blob) for c in CODECS]


def _read_batch(wenv: WalEnv, start_lsn: int, limit: int) -> tuple[int, list[tuple[bytes, bytes]]]:
    def fn(txn: lmdb.Transaction) -> tuple[int, list[tuple[bytes, bytes]]]:
        checkpoint_lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
        cursor = txn.cursor(db=wenv.log)
        if not cursor.set_range(pack_key(start_lsn)):
            return checkpoint_lsn, []
        return checkpoint_lsn, list(islice(cursor, limit))

    return wenv.read(fn)


def replay_batches(wenv: WalEnv, after_lsn: int = 0, batch: int = BATCH) -> Iterator[tuple[int, list[bytes]]]:
    """Yield ``(lsn of the first, values)`` for every record with lsn > ``after_lsn`` (and > the
    checkpoint lsn), a batch at a time: raw record values (``codec`` layout), each verified
    (checksum, known kind, fixed fields present, no bytes after a blob-less kind's fields).

    For callers that decode fields themselves (recovery replays 100k records: a ``Record`` per
    record and a copy of its blob cost more than applying most of them).

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
        # LMDB keys are unique and sorted: first and last in place means no gap in between
        if rows and (unpack_key(rows[0][0]) != expect or unpack_key(rows[-1][0]) != expect + len(rows) - 1):
            for i, (key, _) in enumerate(rows):
                if unpack_key(key) != expect + i:
                    raise WalCorruptError(expect + i, f"missing record: the next stored lsn is {unpack_key(key)}", path)
        values = [value for _, value in rows]
        for i, value in enumerate(values):
            fast = _FAST[value[0]] if value and _crc32c(value) == CRC32C_RESIDUE else None
            end = len(value) - CRC_SIZE
            if fast is None or end < fast[2] or (end > fast[2] and not fast[3]):
                try:  # the slow path names exactly what is wrong
                    decode(expect + i, value)
                except WalCorruptError as exc:
                    error = WalCorruptError(expect + i, exc.reason, path)
                else:  # pragma: no cover
                    raise AssertionError("fast and slow record decoding disagree")
                if i:
                    yield expect, values[:i]  # every record before the bad one is good
                raise error
        if values:
            yield expect, values
        expect += len(values)
        if len(rows) < batch:
            return
        next_lsn = expect


def replay(wenv: WalEnv, after_lsn: int = 0, batch: int = BATCH) -> Iterator[Record]:
    """Yield every record with lsn > ``after_lsn`` (and > the checkpoint lsn), verified.

    Raises:
        WalCorruptError: a bad record or a gap in the lsns (carries the lsn).
        ForkedEnvError: used in a forked child.
    """
    for lsn, values in replay_batches(wenv, after_lsn, batch):
        for value in values:
            kind, unpack_from, fixed, _ = _FAST[value[0]]
            yield _new_record(Record, (lsn, kind, unpack_from(value)[1:], value[fixed:-CRC_SIZE]))
            lsn += 1


def last_lsn(wenv: WalEnv) -> int:
    """The highest lsn in use: the last log key, else the checkpoint lsn, else 0."""

    def fn(txn: lmdb.Transaction) -> int:
        cursor = txn.cursor(db=wenv.log)
        checkpoint_lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
        if cursor.last():
            return max(unpack_key(cursor.key()), checkpoint_lsn)
        return checkpoint_lsn

    return wenv.read(fn)
