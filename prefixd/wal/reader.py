"""Replay: the log after a given lsn, decoded and verified, in lsn order (and ``Prefetch``, the
thread that reads the log's pages ahead of a replay).

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

import logging
import threading
from collections.abc import Iterator
from itertools import islice
from operator import ge, itemgetter, le

import google_crc32c
import lmdb

from prefixd.wal.codec import CRC_SIZE, KEY_SIZE, Record, decode, pack_key, unpack_key
from prefixd.wal.kinds import CODECS
from prefixd.wal.env import WalEnv
from prefixd.wal.errors import WalCorruptError
from prefixd.wal.meta import K_CHECKPOINT, get_u64

log = logging.getLogger(__name__)

BATCH = 4096

# crc32c over a value *including* its stored little-endian crc32c is this constant exactly when
# the stored crc matches (the map x -> crc(body || x) is a bijection): one C call per record, no
# slice of the body and no unpack of the stored value.
CRC32C_RESIDUE = 0x48674BC7
_crc32c = google_crc32c.value
_new_record = tuple.__new__
# per kind code: (kind, fields struct unpack_from, fixed size, has blob), None if unknown
_FAST = [None if c is None else (c.kind, c.struct.unpack_from, c.fixed_size, c.spec.blob) for c in CODECS]


_BIG = 1 << 62
# per kind code: the shortest and longest valid value (kind + fields [+ blob] + crc)
_MIN_LEN = [_BIG if c is None else c.fixed_size + CRC_SIZE for c in CODECS]
_MAX_LEN = [_BIG if c is None or c.spec.blob else c.fixed_size + CRC_SIZE for c in CODECS]
_kind_of = itemgetter(0)


def _read_batch(wenv: WalEnv, start_lsn: int, limit: int) -> tuple[int, bytes, bytes, list[bytes]]:
    """``(checkpoint lsn, first key, last key, values)`` of up to ``limit`` records from
    ``start_lsn`` on (keys ``b""`` when there is none)."""
    def fn(txn: lmdb.Transaction) -> tuple[int, bytes, bytes, list[bytes]]:
        checkpoint_lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
        cursor = txn.cursor(db=wenv.log)
        if not cursor.set_range(pack_key(start_lsn)):
            return checkpoint_lsn, b"", b"", []
        first = cursor.key()
        values = list(islice(cursor.iternext(keys=False, values=True), limit))
        # the cursor rests on the last value taken, or is unset when the log ran out
        last = cursor.key() or (cursor.last() and cursor.key())
        return checkpoint_lsn, first, last, values

    return wenv.read(fn)


def _missing_lsn(wenv: WalEnv, expect: int, limit: int) -> WalCorruptError:
    """The error for a gap somewhere in ``limit`` records from ``expect`` on."""
    def fn(txn: lmdb.Transaction) -> list[bytes]:
        cursor = txn.cursor(db=wenv.log)
        cursor.set_range(pack_key(expect))
        return list(islice(cursor.iternext(keys=True, values=False), limit))

    for i, key in enumerate(wenv.read(fn)):
        if unpack_key(key) != expect + i:
            return WalCorruptError(expect + i, f"missing record: the next stored lsn is {unpack_key(key)}",
                                   wenv.state_dir)
    raise AssertionError("a gap was seen in the log, then not found")  # pragma: no cover


def _all_valid(values: list[bytes]) -> bool:
    """Every value's checksum, kind and length are right (C-level passes, no Python loop)."""
    if list(map(_crc32c, values)).count(CRC32C_RESIDUE) != len(values):
        return False
    try:
        kinds = list(map(_kind_of, values))
    except IndexError:  # an empty value
        return False
    lengths = list(map(len, values))
    return (all(map(ge, lengths, map(_MIN_LEN.__getitem__, kinds)))
            and all(map(le, lengths, map(_MAX_LEN.__getitem__, kinds))))


def _first_invalid(values: list[bytes], first_lsn: int, path: str) -> tuple[int, WalCorruptError]:
    """Index and error of the first bad value (``_all_valid`` said there is one)."""
    for i, value in enumerate(values):
        fast = _FAST[value[0]] if value and _crc32c(value) == CRC32C_RESIDUE else None
        end = len(value) - CRC_SIZE
        if fast is None or end < fast[2] or (end > fast[2] and not fast[3]):
            try:  # the slow path names exactly what is wrong
                decode(first_lsn + i, value)
            except WalCorruptError as exc:
                return i, WalCorruptError(first_lsn + i, exc.reason, path)
            break
    raise AssertionError("fast and slow record checks disagree")  # pragma: no cover


def replay_batches(wenv: WalEnv, after_lsn: int = 0, batch: int = BATCH) -> Iterator[tuple[int, list[bytes]]]:
    """Yield ``(lsn of the first, values)`` for every record with lsn > ``after_lsn`` (and > the
    checkpoint lsn), a batch at a time: raw record values (``codec`` layout), each verified
    (checksum, known kind, fixed fields present, no bytes after a blob-less kind's fields).

    For callers that decode fields themselves (recovery replays 100k records: a ``Record`` per
    record and a copy of its blob cost more than applying most of them).

    Raises:
        WalCorruptError: a bad record or a gap in the lsns (carries the lsn). The records
            before a bad one are yielded first.
        ForkedEnvError: used in a forked child.
    """
    if after_lsn < 0:
        raise ValueError(f"after_lsn must be >= 0, got {after_lsn}")
    expect = None
    next_lsn = after_lsn + 1
    while True:
        checkpoint_lsn, first, last, values = _read_batch(wenv, next_lsn, batch)
        if expect is None:
            expect = max(after_lsn, checkpoint_lsn) + 1
        # LMDB keys are unique and sorted: first and last in place means no gap in between
        if values and (len(first) != KEY_SIZE or len(last) != KEY_SIZE or unpack_key(first) != expect
                       or unpack_key(last) != expect + len(values) - 1):
            raise _missing_lsn(wenv, expect, len(values))
        if not _all_valid(values):
            i, error = _first_invalid(values, expect, wenv.state_dir)
            if i:
                yield expect, values[:i]  # every record before the bad one is good
            raise error
        if values:
            yield expect, values
        expect += len(values)
        if len(values) < batch:
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


def prefetch(wenv: WalEnv, after_lsn: int, step: int = 8, stop: threading.Event | None = None) -> int:
    """Touch the log's pages after ``after_lsn`` so that a replay soon after finds them in the
    page cache; returns how many lookups it made. Meant for a helper thread while the caller
    loads the checkpoint: LMDB releases the GIL inside its lookups, so the page faults (the
    wait for the disk) overlap the caller's work. One lookup per ``step`` lsns: a leaf page
    holds several records.

    Bounded: every lookup must land at least ``step`` lsns past the previous one, and there are
    at most ``entries / step + 1`` of them (the log's own count); it also ends as soon as
    ``stop`` is set. NOTE: a damaged B-tree can answer ``set_range`` with a key *below* the one
    asked for; the loop then went round forever (1 of 10 trials of 50 random bit flips in
    ``data.mdb``). A hint has no business judging the log: it stops, and replay, which checks
    every record, reports the damage.
    """
    def fn(txn: lmdb.Transaction) -> int:
        cursor = txn.cursor(db=wenv.log)
        max_lookups = txn.stat(wenv.log)["entries"] // step + 1
        lsn, n = after_lsn + 1, 0
        while n < max_lookups and not (stop is not None and stop.is_set()) and cursor.set_range(pack_key(lsn)):
            n += 1
            key = cursor.key()
            found = unpack_key(key) if len(key) == KEY_SIZE else -1
            if found < lsn:  # the tree went backwards (or a malformed key): damaged, stop here
                break
            lsn = found + step
        return n

    return wenv.read(fn)


class Prefetch:
    """A helper thread that reads the log tail into the page cache while recovery loads the
    checkpoint (``Wal.prefetch``); a hint only: replay reads and checks every record itself.

    Invariant: its read transaction ends when the thread does, and ``stop()`` ends the thread
    within one lookup (the loop checks the event before each), so no error path waits on it
    for longer than ``STOP_TIMEOUT_S``; the thread is a daemon, so it never holds up the
    interpreter's exit either.
    """

    STOP_TIMEOUT_S = 5.0

    def __init__(self, wenv: WalEnv, after_lsn: int) -> None:
        self._stop = threading.Event()
        self.lookups = 0
        self._thread = threading.Thread(target=self._run, args=(wenv, after_lsn),
                                        name="prefixd-wal-prefetch", daemon=True)
        self._thread.start()

    def _run(self, wenv: WalEnv, after_lsn: int) -> None:
        try:
            self.lookups = prefetch(wenv, after_lsn, stop=self._stop)
        except Exception as exc:  # a hint only: replay reads (and checks) everything itself
            log.debug("wal prefetch stopped: %r", exc)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end by itself, at most ``timeout_s``; returns whether it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Ask the thread to end and wait for it, at most ``timeout_s``; returns whether it ended."""
        self._stop.set()
        return self.join(timeout_s)


def last_lsn(wenv: WalEnv) -> int:
    """The highest lsn in use: the last log key, else the checkpoint lsn, else 0."""

    def fn(txn: lmdb.Transaction) -> int:
        cursor = txn.cursor(db=wenv.log)
        checkpoint_lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
        if cursor.last():
            return max(unpack_key(cursor.key()), checkpoint_lsn)
        return checkpoint_lsn

    return wenv.read(fn)
