"""``Wal``: the write-ahead log of one state directory (lock, environment, meta, group commit).

Open order: state lock (a second daemon is refused before anything is touched) -> LMDB
environment (process registry) -> meta validation and epoch bump -> lsn counter from the log ->
committer thread. Close order is the reverse.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from prefixd.wal.checkpoint_store import CheckpointWriter, read_checkpoint
from prefixd.wal.codec import Record
from prefixd.wal.env import DEFAULT_MAP_SIZE, MAX_MAP_SIZE, WalEnv, is_open_here
from prefixd.wal.errors import EnvAlreadyOpenError, WalClosedError, WalFailedError
from prefixd.wal.group import GroupCommitter, WalStats
from prefixd.wal.lock import StateDirLock
from prefixd.wal.meta import MetaInfo, open_meta
from prefixd.wal.reader import Prefetch, last_lsn, replay, replay_batches

T = TypeVar("T")

log = logging.getLogger(__name__)


class Wal:
    """The write-ahead log of a state directory. See the ``prefixd.wal`` docstring for the format.

    Structure: ``StateDirLock`` (flock on ``<state_dir>/lock``) + ``WalEnv`` (LMDB under
    ``<state_dir>/wal``) + ``MetaInfo`` of this open + ``GroupCommitter`` (the committer thread)
    + ``CheckpointWriter`` (a checkpoint's job on that thread) + the ``Prefetch`` threads of
    recovery.

    Thread-safety: ``append``, ``flush``, ``commit_now``, ``checkpoint``, ``submit_checkpoint``,
    ``stats`` may be called from any thread of the opening process. ``replay`` and
    ``load_checkpoint`` are safe concurrently too but meant for recovery, before appends start.
    Nothing may be called from a forked child (:class:`ForkedEnvError`).

    Invariants: lsns are assigned by ``append`` in call order, 1, 2, 3... continuing after a
    restart from ``max(last log lsn, checkpoint lsn) + 1``; a ticket for lsn L resolves only once
    every record <= L is durable per ``sync``; after any commit/fsync failure the Wal is poisoned
    for good.
    """

    def __init__(self, state_dir: str, *, layouts: bytes | None = None, sync: str = "commit",
                 interval_ms: float = 1000.0, max_delay_ms: float = 5.0,
                 max_group_records: int = 4096, map_size: int = DEFAULT_MAP_SIZE,
                 max_map_size: int = MAX_MAP_SIZE) -> None:
        """Open (creating if needed) the log of ``state_dir`` and start its committer.

        Args:
            state_dir: the daemon's state directory.
            layouts: the KV layouts as bytes; refused if a different value was saved. None skips
                the check (offline tools).
            sync: ``commit`` (fsync each group; power-safe), ``interval`` (fsync at most every
                ``interval_ms``; a crash of the process loses nothing committed, a power cut up
                to one interval), ``none`` (benchmarks only).
            interval_ms: the fsync period of ``interval``.
            max_delay_ms: how long an unflushed record may wait before its group is committed.
            max_group_records: a pending group this large is committed without waiting.
            map_size, max_map_size: the initial LMDB map and the ceiling of its doubling.

        Raises:
            EnvAlreadyOpenError: this process already has ``state_dir`` open.
            StateLockedError: another process holds the state directory.
            StateMismatchError: format version, kinds or layouts differ from the saved ones.
            ValueError: a bad ``sync``.
        """
        if sync not in ("commit", "interval", "none"):
            raise ValueError(f"sync must be 'commit', 'interval' or 'none', got {sync!r}")
        real = os.path.realpath(state_dir)
        if is_open_here(real):  # before the flock, which would name our own pid
            raise EnvAlreadyOpenError(real)
        self.state_dir = real
        self.sync = sync
        self._lock = StateDirLock(real)
        self._wenv: WalEnv | None = None
        try:
            self._wenv = WalEnv(real, sync=(sync == "commit"), map_size=map_size, max_map_size=max_map_size)
            self.meta: MetaInfo = open_meta(self._wenv, layouts)
            self._committer = GroupCommitter(
                self._wenv, sync=sync, next_lsn=last_lsn(self._wenv) + 1, interval_s=interval_ms / 1e3,
                max_delay_s=max_delay_ms / 1e3, max_group_records=max_group_records,
            )
            self._checkpoints = CheckpointWriter(self._wenv, self._committer, sync=sync)
        except BaseException:
            if self._wenv is not None:
                self._wenv.close()
            self._lock.release()
            raise
        self._closed = False
        self._close_lock = threading.Lock()
        self._prefetches: list[Prefetch] = []
        # NOTE: the hot path skips one Python frame: the instance attribute shadows the method
        # below, which stays for its documentation.
        self.append = self._committer.append  # type: ignore[method-assign]
        self.append_many = self._committer.append_many  # type: ignore[method-assign]
        self.append_values = self._committer.append_values  # type: ignore[method-assign]
        self._committer.start()

    # --- appending ----------------------------------------------------------------------------------

    def append(self, kind: int, *fields: int | float, blob: bytes = b"") -> int:
        """Buffer one record into the pending group. Cheap: encodes, takes a lock, no I/O.

        Args:
            kind: a ``Kind``.
            *fields: the kind's fixed fields in order (``kinds.KIND_SPECS``).
            blob: trailing bytes, for kinds that carry one.

        Returns:
            The record's lsn.

        Raises:
            ValueError: wrong kind, field count or range, or a blob on a blob-less kind.
            WalFailedError: the log is poisoned. WalClosedError: closed. ForkedEnvError.
        """
        return self._committer.append(kind, *fields, blob=blob)  # shadowed in __init__

    def append_many(self, records) -> int:
        """``append`` for a batch of ``(kind, fields, blob)`` records, in order, under one lock.

        Returns:
            The lsn of the last record. Raises as ``append`` (nothing appended on a bad record).
        """
        return self._committer.append_many(records)  # shadowed in __init__

    def append_values(self, values) -> int:
        """Buffer record values encoded already (``prefixd.wal.codec.frame`` of a kind's packed
        fields and blob), in order, under one lock: the engine's path, which packs each kind
        itself (``prefixd.engine.records.encode_events``). Nothing is re-checked: a value must
        be a well-formed record, or replay refuses the log there.

        Returns:
            The lsn of the last value (the one before, if none).
        """
        return self._committer.append_values(values)  # shadowed in __init__

    def flush(self) -> Future:
        """A ticket for every record appended so far (by any thread).

        Returns:
            A ``concurrent.futures.Future`` resolved with the durable lsn once those records are
            durable per ``sync`` (``interval``: after the next periodic fsync), or failed with
            :class:`WalFailedError`. Flushes of one group share one Future.
        """
        return self._committer.flush()

    def flush_into(self, waiters) -> None:
        """``flush`` into the caller's own futures: each ``(future, value)`` of ``waiters`` is
        resolved with its value once every record appended so far is durable (or failed with
        :class:`WalFailedError`), saving a Future chained on the shared one."""
        self._committer.flush_into(waiters)

    def commit_now(self) -> int:
        """Commit everything pending and fsync it, whatever ``sync`` is; block until done.

        Returns:
            The durable lsn. Raises WalFailedError if the commit or fsync fails.
        """
        committer = self._committer
        if self.sync == "commit":  # every committed group is already fsynced
            return committer.submit(lambda: committer.stats().durable_lsn).result()
        return committer.submit(committer.sync_now).result()

    def fail(self, cause: BaseException) -> WalFailedError:
        """Poison the log for a failure outside it, and return the error to raise.

        For a caller that can no longer log what it did: typically the fdatasync of a data file
        that its next records would describe failed, so those records must never be written and
        nothing after them acknowledged (a retried fdatasync may "succeed" over pages the kernel
        dropped). Records appended before this call are committed first; the log accepts nothing
        more, exactly as after a failed commit of its own.

        Returns:
            The ``WalFailedError`` (``__cause__`` is ``cause`` unless the log had already failed).
        """

        def job() -> None:
            raise cause

        try:
            self._committer.submit(job).result()
        except WalFailedError as exc:
            return exc
        raise AssertionError("a failing job did not poison the log")  # pragma: no cover

    # --- checkpoint ---------------------------------------------------------------------------------

    def submit_checkpoint(self, lsn: int, index: dict[bytes, bytes], seqs: dict[bytes, bytes]) -> Future:
        """Queue a checkpoint on the committer, behind every record appended before this call.

        In ONE write txn: replace ``index``/``seqs`` wholly with the given maps, set the
        checkpoint lsn, delete every log record with lsn <= ``lsn``. Appends may continue
        meanwhile; they land in the groups after it. Values may be any contiguous buffer of any
        size (chunked transparently), or a list of its chunks (``checkpoint_store._chunks``).
        The caller must not mutate the buffers until it resolves.

        Args:
            lsn: the last lsn the checkpointed state includes; at most the last appended lsn and
                at least the saved checkpoint lsn.

        Returns:
            A Future resolved with ``lsn`` once the checkpoint is durable (fsynced unless
            ``sync="none"``); ValueError for bad arguments (nothing written); WalFailedError.
        """
        next_lsn = self._committer.stats().next_lsn
        if not 0 <= lsn < next_lsn:
            raise ValueError(f"checkpoint lsn {lsn} is beyond the last appended lsn {next_lsn - 1}")
        self._env()  # WalClosedError once closed
        return self._committer.submit(functools.partial(self._checkpoints.write, lsn, index, seqs))

    def checkpoint(self, lsn: int, index: dict[bytes, bytes], seqs: dict[bytes, bytes]) -> int:
        """``submit_checkpoint(...).result()``: block until the checkpoint is durable."""
        return self.submit_checkpoint(lsn, index, seqs).result()

    def load_checkpoint(self) -> tuple[int, dict[bytes, bytes], dict[bytes, bytes]]:
        """Return ``(checkpoint_lsn, index, seqs)`` as last written (``(0, {}, {})`` if none).

        Raises:
            WalCorruptError: a checkpoint chunk fails its checksum or is missing.
        """
        wenv = self._env()
        return wenv.read(lambda txn: read_checkpoint(txn, wenv), buffers=True)

    def with_checkpoint(self, fn: Callable[[int, dict, dict], T]) -> T:
        """``fn(checkpoint_lsn, index, seqs)`` inside one read transaction, each value given as
        its list of chunks: memoryviews into the map, valid only until ``fn`` returns (copy
        what you keep). Saves a copy of every value over ``load_checkpoint``: a 1M-block
        checkpoint is ~90 MB.

        Raises:
            WalCorruptError: a checkpoint chunk fails its checksum or is missing.
        """
        wenv = self._env()
        return wenv.read(lambda txn: fn(*read_checkpoint(txn, wenv, join=False)), buffers=True)

    def replay(self, after_lsn: int = 0) -> Iterator[Record]:
        """Committed records with lsn > ``max(after_lsn, checkpoint lsn)``, verified, in lsn order.

        Raises (while iterating):
            WalCorruptError: a bad record or an lsn gap, with the lsn.
        """
        return replay(self._env(), after_lsn)

    def prefetch(self, after_lsn: int = 0) -> Prefetch:
        """Start a helper thread that reads the log after ``after_lsn`` into the page cache (see
        ``prefixd.wal.reader.prefetch``). Call ``stop()`` on the result once replay is done (or
        has failed); ``close`` stops any still running."""
        prefetching = Prefetch(self._env(), after_lsn)
        self._prefetches = [p for p in self._prefetches if p.running] + [prefetching]
        return prefetching

    def replay_batches(self, after_lsn: int = 0) -> Iterator[tuple[int, list[bytes]]]:
        """``replay``, as ``(lsn of the first, raw verified values)`` batches (see
        ``prefixd.wal.reader.replay_batches``), for callers that decode fields themselves."""
        return replay_batches(self._env(), after_lsn)

    # --- state --------------------------------------------------------------------------------------

    def open_epoch(self) -> int:
        """The daemon epoch of this open (incremented once per open, persisted in meta)."""
        return self.meta.epoch

    @property
    def root_seed(self) -> bytes:
        """The 16-byte root seed, created with the state directory and never changed."""
        return self.meta.root_seed

    @property
    def failure(self):
        """The WalFailedError that poisoned this log, or None."""
        return self._committer.failure

    @property
    def durable_lsn(self) -> int:
        """Every record <= this lsn is durable per ``sync`` (cheap: no lock, no tuple)."""
        return self._committer.durable_lsn

    def stats(self) -> WalStats:
        """Counters for metrics: groups, records, last group size, commit latency, lsns."""
        return self._committer.stats()

    def _env(self) -> WalEnv:
        if self._closed:
            raise WalClosedError(f"write-ahead log {self.state_dir} is closed")
        assert self._wenv is not None
        return self._wenv

    def close(self) -> None:
        """Commit and fsync what is pending (unless poisoned), stop the committer, close LMDB,
        release the state lock. Idempotent. In a forked child it only forgets the handles."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._wenv is not None and self._wenv.in_forked_child:
            self._wenv.close()
            return
        stuck = [p for p in self._prefetches if not p.stop()]
        try:
            self._committer.close()
        finally:
            assert self._wenv is not None
            if stuck:  # pragma: no cover - LMDB lookups are bounded by the tree depth
                # NOTE: unmapping the file under a reader that is still inside LMDB would crash
                # the process; the environment stays open (and registered) until it exits.
                log.error("wal prefetch did not stop; environment left open path=%s", self.state_dir)
            else:
                self._wenv.close()
            self._lock.release()

    def __enter__(self) -> Wal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_invariants(self) -> None:
        """Assert lsn order, pending order, registry membership and lock ownership."""
        self._committer.check_invariants()
        if not self._closed and self._wenv is not None:
            self._wenv.check_invariants()
            self._lock.check_invariants()
            stats = self._committer.stats()
            assert stats.committed_lsn >= self.meta.checkpoint_lsn, "lsn counter behind the checkpoint"

