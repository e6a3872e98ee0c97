"""The LMDB environment of a state directory, and the hygiene rules around it.

Rules enforced here (LMDB's own documentation states them; breaking them corrupts or deadlocks):

- One environment per process and files: a module-level registry refuses a second open of the
  same state directory in this process (:class:`EnvAlreadyOpenError`).
- Never across ``fork()``: the opening pid is recorded and every use from another pid raises
  :class:`ForkedEnvError`.
- ``set_mapsize`` only with no transaction active in the process: every read transaction of this
  package runs under a reader gate, and map growth (on ``MapFullError``: double, retry the whole
  transaction) waits for the gate to drain.
- Stale reader slots (left by killed processes) are cleared with ``reader_check()`` at open and
  periodically by the committer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import lmdb

from prefixd.wal.datafile import check_structure, pad_data_file
from prefixd.wal.errors import EnvAlreadyOpenError, ForkedEnvError, WalCorruptError, WalError

log = logging.getLogger(__name__)

T = TypeVar("T")

ENV_DIR = "wal"  # the LMDB environment lives in <state_dir>/wal/{data,lock}.mdb
DB_NAMES = (b"log", b"index", b"seqs", b"meta")
MAX_DBS = 8  # 4 used; room for one more without a format change
DEFAULT_MAP_SIZE = 1 << 30  # virtual address space only; the file grows as pages are used
MAX_MAP_SIZE = 1 << 40

_registry: dict[str, int] = {}  # realpath of state dir -> opening pid
_registry_lock = threading.Lock()
_pid = [os.getpid()]


def _after_fork_in_child() -> None:
    _pid[0] = os.getpid()
    _registry.clear()  # the parent's environments are unusable here; the child may open its own


os.register_at_fork(after_in_child=_after_fork_in_child)


def is_open_here(state_dir: str) -> bool:
    """Whether this process has the environment of ``state_dir`` open."""
    with _registry_lock:
        return os.path.realpath(state_dir) in _registry


# LMDB's errors for a page that does not hold what the B-tree expects (a zeroed or overwritten
# page): the file is damaged, which is what WalCorruptError says.
_DAMAGED = (lmdb.CorruptedError, lmdb.PageNotFoundError,
            # a transaction LMDB marked failed inside (a damaged page met during a put or a
            # lookup); our code never reuses a transaction, so this is the file too
            lmdb.BadTxnError, lmdb.PanicError,
            # a named database's record in the main tree changed under its open handle, or its
            # flags no longer match: nothing else writes that record (the bit-flip soak met
            # MDB_BAD_DBI on the first read after open)
            lmdb.BadDbiError, lmdb.IncompatibleError)
# ... and for a file whose meta pages are not LMDB's (lmdb.open)
_NOT_LMDB = _DAMAGED + (lmdb.InvalidError, lmdb.VersionMismatchError)


class _ReaderGate:
    """Counts active read transactions; ``exclusive()`` blocks new ones and waits for zero."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._readers = 0
        self._growing = False

    def enter(self) -> None:
        with self._cv:
            while self._growing:
                self._cv.wait()
            self._readers += 1

    def leave(self) -> None:
        with self._cv:
            self._readers -= 1
            if self._readers == 0:
                self._cv.notify_all()

    def run_exclusive(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._growing = True
            try:
                while self._readers:
                    self._cv.wait()
                fn()
            finally:
                self._growing = False
                self._cv.notify_all()


class WalEnv:
    """An open LMDB environment under ``<state_dir>/wal`` with the four named databases.

    Fields: ``env`` (the ``lmdb.Environment``), ``log``/``index``/``seqs``/``meta`` (handles),
    ``state_dir`` (real path, the registry key), ``pid`` (the opening process).

    Invariants: registered in the process registry under ``state_dir`` iff open; used only by
    ``pid``; ``map_size`` only grows.

    NOTE: ``sync`` is fixed at open because LMDB's MDB_NOSYNC cannot be changed through py-lmdb
    afterwards. ``sync=True`` makes each commit two fdatasyncs with the meta page written between
    them, which is what keeps the file consistent under power loss; ``sync=False`` leaves
    durability to an explicit ``env.sync(True)`` (see the package docstring for when each is used).
    """

    def __init__(self, state_dir: str, *, sync: bool, map_size: int = DEFAULT_MAP_SIZE,
                 max_map_size: int = MAX_MAP_SIZE) -> None:
        """Open (creating if needed) the environment of ``state_dir``.

        Raises:
            EnvAlreadyOpenError: this process already has it open.
            WalCorruptError: ``data.mdb`` fails the walk of its pages (``check_structure``: a
                truncated file, a damaged page, a newest meta page whose last page lies past
                its map or ``max_map_size``), or LMDB finds it is not an LMDB file of its
                version (a damaged meta page).
            lmdb.Error: LMDB could not open the files.
        """
        self.state_dir = os.path.realpath(state_dir)
        self.pid = os.getpid()
        self.max_map_size = max_map_size
        with _registry_lock:
            if self.state_dir in _registry:
                raise EnvAlreadyOpenError(self.state_dir)
            _registry[self.state_dir] = self.pid
        try:
            path = os.path.join(self.state_dir, ENV_DIR)
            os.makedirs(path, mode=0o750, exist_ok=True)
            data = os.path.join(path, "data.mdb")
            check_structure(data, self.state_dir, max_map_size)  # a SIGBUS otherwise (datafile's docstring)
            pad_data_file(data)  # after the walk: the padding would hide a truncation from it
            try:
                self.env = lmdb.open(
                    path, map_size=map_size, subdir=True, max_dbs=MAX_DBS, sync=sync, metasync=True,
                    lock=True,
                )
                self.log, self.index, self.seqs, self.meta = (self.env.open_db(n) for n in DB_NAMES)
            except lmdb.Error as exc:
                if getattr(self, "env", None) is not None:
                    self.env.close()
                # the base class is what py-lmdb raises for a data format it does not know (a
                # flipped version field); its subclasses name other causes (permissions, I/O)
                if isinstance(exc, _NOT_LMDB) or type(exc) is lmdb.Error:
                    raise WalCorruptError(-1, f"LMDB cannot open data.mdb: {exc}", self.state_dir) from exc
                raise
        except BaseException:
            with _registry_lock:
                _registry.pop(self.state_dir, None)
            raise
        self._gate = _ReaderGate()
        self._closed = False
        self.num_map_grows = 0
        self.reader_check()

    # --- guards -------------------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise unless this environment may be used from the calling process.

        Raises:
            ForkedEnvError: called in a forked child. WalError: closed.
        """
        if self.pid != _pid[0]:
            raise ForkedEnvError(self.state_dir, self.pid, _pid[0])
        if self._closed:
            raise WalError(f"write-ahead log environment {self.state_dir} is closed")

    @property
    def in_forked_child(self) -> bool:
        """True when called in a process other than the one that opened the environment."""
        return self.pid != _pid[0]

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]

    # --- transactions --------------------------------------------------------------------------

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn(txn)`` in one write transaction and commit it; grow the map and rerun on
        ``MapFullError``. ``fn`` must be safe to rerun from scratch (it is, when it only puts).

        Raises:
            WalError: the map would exceed ``max_map_size``. WalCorruptError: LMDB found a damaged
            page. lmdb.Error: any other LMDB failure
            (including a failed fsync inside commit when the env syncs on commit).
        """
        self.check_usable()
        while True:
            txn = self.env.begin(write=True)
            try:
                result = fn(txn)
                txn.commit()
                return result
            except lmdb.MapFullError:
                txn.abort()
                self._grow()
            except _DAMAGED as exc:
                txn.abort()
                raise WalCorruptError(-1, f"LMDB found a damaged page while writing: {exc}", self.state_dir) from exc
            except BaseException:
                txn.abort()
                raise

    def read(self, fn: Callable[[lmdb.Transaction], T], buffers: bool = False) -> T:
        """Run ``fn(txn)`` in a read transaction (under the reader gate) and return its result.
        ``fn`` must copy what it keeps: the transaction ends when it returns (with ``buffers``,
        values are memoryviews into the map, valid only inside ``fn``)."""
        self.check_usable()
        self._gate.enter()
        try:
            with self.env.begin(buffers=buffers) as txn:
                return fn(txn)
        except _DAMAGED as exc:  # LMDB's own checks of a page: a typed error, like ours
            raise WalCorruptError(-1, f"LMDB found a damaged page while reading: {exc}", self.state_dir) from exc
        finally:
            self._gate.leave()

    def _grow(self) -> None:
        old = self.map_size
        new = old * 2
        if new > self.max_map_size:
            raise WalError(
                f"write-ahead log {self.state_dir} needs a map over max_map_size={self.max_map_size}"
                f" bytes (now {old}); raise the limit or checkpoint more often"
            )
        self._gate.run_exclusive(lambda: self.env.set_mapsize(new))
        self.num_map_grows += 1
        log.info("wal map grown path=%s old=%s new=%s", self.state_dir, old, new)

    # --- maintenance ---------------------------------------------------------------------------

    def reader_check(self) -> int:
        """Clear reader slots of dead processes; returns how many were cleared."""
        self.check_usable()
        stale = self.env.reader_check()
        if stale:
            log.warning("wal cleared stale lmdb readers path=%s count=%s", self.state_dir, stale)
        return stale

    def sync(self) -> None:
        """fsync the data file (``mdb_env_sync(force=1)``). Raises lmdb.Error on failure."""
        self.check_usable()
        self.env.sync(True)

    def close(self) -> None:
        """Close the environment and leave the registry (idempotent).

        In a forked child this only forgets the handle: closing would touch the parent's locks.
        """
        if self._closed:
            return
        self._closed = True
        if self.pid != _pid[0]:
            log.warning("wal env inherited across fork not closed in child path=%s", self.state_dir)
            return
        try:
            self.env.close()
        finally:
            with _registry_lock:
                if _registry.get(self.state_dir) == self.pid:
                    del _registry[self.state_dir]

    def check_invariants(self) -> None:
        """Assert the registry agrees with the open state."""
        if self._closed or self.pid != _pid[0]:
            return
        assert _registry.get(self.state_dir) == self.pid, "open env missing from the registry"
        assert self.map_size <= self.max_map_size
