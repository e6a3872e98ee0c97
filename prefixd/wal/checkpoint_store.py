"""Checkpoint storage: ``index``/``seqs`` as chunked, checksummed values, plus log truncation.

A checkpoint is the caller's state at some lsn L, given as two maps of opaque byte strings
(``index`` and ``seqs``; the cache defines their contents, typically a handful of columnar numpy
buffers of up to hundreds of MB). Writing one replaces the previous one wholly, sets
``meta.checkpoint_lsn = L`` and deletes every log record with lsn <= L, all in the caller's single
write transaction, so a crash leaves either the old checkpoint with its log or the new one.

Stored layout, per user key K (1..507 bytes) and value V::

    key   K || chunk number (u32 big-endian)        for chunk 0 .. ceil(len(V) / CHUNK_SIZE) - 1
    value xxh3-64(chunk) (u64 little-endian) || chunk bytes

An empty V is one empty chunk. The fixed-width suffix makes the split unambiguous; chunks of one
key come back in order (though another key may sort between them, so readers group by K).

Written as a committer job (``CheckpointWriter.write``, queued by ``Wal.submit_checkpoint``), so
it serializes with the groups. A full filesystem aborts the transaction before its meta page:
``WalNoSpaceError``, the log as it was and not poisoned.

NOTE: why chunk at all: LMDB stores a value larger than a page in *contiguous* overflow pages; a
100 MB value needs a 25,600-page contiguous run, which the free list rarely has after a few
checkpoints, so every checkpoint would grow the file. 1 MiB chunks reuse freed pages.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from typing import TYPE_CHECKING

import lmdb
import xxhash

from prefixd.crashpoints import crash_point
from prefixd.wal.codec import pack_key, unpack_key
from prefixd.wal.env import WalEnv
from prefixd.wal.errors import WalCorruptError, WalNoSpaceError
from prefixd.wal.meta import K_CHECKPOINT, get_u64, put_u64

if TYPE_CHECKING:
    from prefixd.wal.group import GroupCommitter

log = logging.getLogger(__name__)

CHUNK_SIZE = 1 << 20
_SUFFIX = struct.Struct(">I")
_HASH = struct.Struct("<Q")
MAX_USER_KEY = 511 - _SUFFIX.size  # LMDB's default max key size is 511 bytes
_xxh3 = xxhash.xxh3_64_intdigest
_NO_SPACE = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


class CheckpointWriter:
    """The checkpoint's job on the committer thread: one write transaction that replaces the
    checkpoint and folds the log (``write_checkpoint``), then the fsync ``sync`` still owes, then
    the count. ``Wal.submit_checkpoint`` checks the lsn and queues ``write`` behind every record
    appended before it.

    Thread safety: ``write`` runs on the committer thread only (queued, or inline there).
    """

    def __init__(self, wenv: WalEnv, committer: GroupCommitter, *, sync: str) -> None:
        self._wenv = wenv
        self._committer = committer
        self._sync = sync

    def write(self, lsn: int, index: dict, seqs: dict) -> int:
        """Write the checkpoint of ``lsn`` (see ``Wal.submit_checkpoint``); returns ``lsn``.

        Raises:
            WalNoSpaceError: the filesystem is full (the log is as it was, not poisoned).
            ValueError: bad keys or values, or ``lsn`` below the saved checkpoint lsn.
            and whatever the environment raises (the committer then poisons the log).
        """
        wenv, committer = self._wenv, self._committer

        def txn_fn(txn) -> int:
            deleted = write_checkpoint(txn, wenv, lsn, index, seqs)
            crash_point("wal_checkpoint_inside")
            return deleted

        try:
            deleted = wenv.write(txn_fn)
        except lmdb.Error as exc:
            if not _no_space(exc, wenv.state_dir, index, seqs):
                raise
            # NOTE: the transaction was aborted before its meta page: the log is as it was,
            # so it is not poisoned (every record is kept; the checkpoint is retried)
            raise WalNoSpaceError(wenv.state_dir, exc) from exc
        if self._sync == "interval":  # "commit": the env fsynced inside commit
            committer.sync_now()
        committer.count_checkpoint()
        log.info("wal checkpoint path=%s lsn=%s folded=%s", wenv.state_dir, lsn, deleted)
        return lsn


def _chunk_rows(items: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    rows = []
    for key, value in items.items():
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_USER_KEY:
            raise ValueError(f"checkpoint keys must be 1..{MAX_USER_KEY} bytes, got {key!r:.60}")
        for number, chunk in enumerate(_chunks(key, value)):
            rows.append((key + _SUFFIX.pack(number), _HASH.pack(_xxh3(chunk)) + chunk))
    rows.sort(key=lambda row: row[0])
    return rows


def _chunks(key: bytes, value) -> list[memoryview]:
    """``value``'s ``CHUNK_SIZE`` chunks: of one contiguous buffer, or checked when the value
    is given as its list of chunks (each ``CHUNK_SIZE`` bytes but the last, which is not
    empty unless it is the only one), stored exactly as the joined value would be."""
    if isinstance(value, (list, tuple)):
        chunks = [_bytes_view(c) for c in value]
        sizes = [c.nbytes for c in chunks]
        whole = all(n == CHUNK_SIZE for n in sizes[:-1])
        if not chunks or not whole or sizes[-1] > CHUNK_SIZE or (not sizes[-1] and len(sizes) > 1):
            raise ValueError(f"checkpoint value {key!r:.60} given as chunks must be chunks of "
                             f"{CHUNK_SIZE} bytes (the last one shorter, not empty), got "
                             f"{sizes[:4]}... ({len(sizes)} chunks)")
        return chunks
    view = _bytes_view(value)
    return [view[start : start + CHUNK_SIZE] for start in range(0, max(view.nbytes, 1), CHUNK_SIZE)]


def _bytes_view(buffer) -> memoryview:
    view = memoryview(buffer)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def write_checkpoint(txn: lmdb.Transaction, wenv: WalEnv, lsn: int,
                     index: dict[bytes, bytes], seqs: dict[bytes, bytes]) -> int:
    """Replace the checkpoint and fold the log up to ``lsn``, inside the caller's write txn.

    Args:
        txn: an open write transaction (committed by the caller).
        wenv: the environment (for the database handles).
        lsn: the lsn the checkpoint folds; must be >= the saved checkpoint lsn.
        index, seqs: the checkpoint maps (values: any contiguous buffer, or a list of
            ``CHUNK_SIZE`` chunks, the last one shorter: ``_chunks``).

    Returns:
        How many log records were deleted.

    Raises:
        ValueError: bad keys, or ``lsn`` below the saved checkpoint lsn.
    """
    saved = get_u64(txn, wenv.meta, K_CHECKPOINT)
    if lsn < saved:
        raise ValueError(f"checkpoint lsn {lsn} is below the saved checkpoint lsn {saved}")
    for db, items in ((wenv.index, index), (wenv.seqs, seqs)):
        rows = _chunk_rows(items)
        txn.drop(db, delete=False)
        # NOTE: one put per chunk, not one ``putmulti`` of them all: a put copies one chunk
        # holding the GIL, so a checkpoint written beside the daemon's event loop holds it
        # from the loop for a chunk's copy at a time, not for the whole value's
        cursor = txn.cursor(db=db)
        for row_key, row_value in rows:
            if not cursor.put(row_key, row_value, append=True):
                raise lmdb.Error(f"checkpoint put of chunk {row_key[:40]!r} failed")
    put_u64(txn, wenv.meta, K_CHECKPOINT, lsn)
    return _truncate_log(txn, wenv, lsn)


def _truncate_log(txn: lmdb.Transaction, wenv: WalEnv, lsn: int) -> int:
    cursor = txn.cursor(db=wenv.log)
    if not cursor.last():
        return 0
    if unpack_key(cursor.key()) <= lsn:  # fast path: the whole log is folded
        count = txn.stat(wenv.log)["entries"]
        txn.drop(wenv.log, delete=False)
        return count
    end = pack_key(lsn)
    count = 0
    cursor.first()
    while cursor.key() <= end:  # big-endian keys: byte order is lsn order
        cursor.delete()  # moves to the next record
        count += 1
    return count


def read_checkpoint(txn: lmdb.Transaction, wenv: WalEnv, join: bool = True) -> tuple[int, dict, dict]:
    """Read the checkpoint: ``(checkpoint_lsn, index, seqs)``; ``(0, {}, {})`` if none was written.

    ``join=False`` leaves each value as its list of chunks, as the transaction gives them
    (memoryviews into the map when it was begun with ``buffers=True``: valid only inside it).

    Raises:
        WalCorruptError: a chunk fails its checksum or a chunk number is missing (lsn = the
            checkpoint lsn).
    """
    lsn = get_u64(txn, wenv.meta, K_CHECKPOINT)
    maps = []
    for db in (wenv.index, wenv.seqs):
        parts: dict[bytes, list[bytes]] = {}
        for key, value in txn.cursor(db=db):
            if len(key) <= _SUFFIX.size or len(value) < _HASH.size:
                raise WalCorruptError(lsn, f"checkpoint entry {bytes(key)[:40]!r} is too short", wenv.state_dir)
            user = bytes(key[: -_SUFFIX.size])
            (number,) = _SUFFIX.unpack_from(key, len(key) - _SUFFIX.size)
            chunk = value[_HASH.size :]
            if _HASH.unpack_from(value)[0] != _xxh3(chunk):
                raise WalCorruptError(lsn, f"checkpoint key {user[:40]!r} chunk {number}: checksum mismatch", wenv.state_dir)
            chunks = parts.setdefault(user, [])
            if number != len(chunks):
                raise WalCorruptError(lsn, f"checkpoint key {user[:40]!r}: chunk {number} follows {len(chunks)} chunks", wenv.state_dir)
            chunks.append(chunk)  # a view into the map (buffers=True): one copy, below
        if join:
            maps.append({k: bytes(c[0]) if len(c) == 1 else b"".join(c) for k, c in parts.items()})
        else:
            maps.append(parts)
    return lsn, maps[0], maps[1]


def _no_space(exc: BaseException, state_dir: str, index: dict, seqs: dict) -> bool:
    """Whether a checkpoint's LMDB error is a full filesystem (py-lmdb keeps only the
    ``strerror`` text): ENOSPC, EDQUOT, or EIO (LMDB's word for a write cut short) while the
    filesystem has less free space than the checkpoint's values."""
    text = str(exc)
    if any(t in text for t in _NO_SPACE):
        return True
    if os.strerror(errno.EIO) not in text:
        return False
    need = 0
    for value in (*index.values(), *seqs.values()):
        need += sum(memoryview(c).nbytes for c in value) if isinstance(value, (list, tuple)) \
            else memoryview(value).nbytes
    try:
        st = os.statvfs(state_dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < need
