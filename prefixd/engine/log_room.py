"""``LogRoom``: the room one pool's log keeps past its end, so that a filesystem another
process fills cannot fail the log's next commits or its next checkpoint.

LMDB's ``data.mdb`` grows by writes as records are appended and as a checkpoint is written
beside the one it replaces (its pages freed only once the new one commits). The room is
blocks allocated past the file's end (``falloc.reserve``, ``FALLOC_FL_KEEP_SIZE``): the
file grows into blocks it already has. It is ``max(LOG_POOL_ROOM, CHECKPOINT_ROOM_FACTOR x
the checkpoint's bytes)`` past the end, and kept so: ``keep`` (the engine's tick, and after
each checkpoint) reserves again once less than half of it is left, so the room follows the
file as the log grows and the map's pages are used.

Only ``LOG_POOL_ROOM`` is charged to the pool's tenant in the disk ledger; room above it (a
pool whose checkpoint is larger) comes out of the logs' own share of the disk budget
(``Budgets.log_reserve``, kept out of every pool's reach at start), and all pools together
take at most half of that (``LogRooms.extra_limit``): the other half is the logs' growth.

Closing a pool (``release``) punches the room past the end (``FALLOC_FL_PUNCH_HOLE``): a
closed pool's log takes only what it holds.
"""

from __future__ import annotations

import logging
import os

from prefixd.storage import falloc
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import NoSpaceError, StorageError

log = logging.getLogger(__name__)

MiB = 1 << 20
# NOTE: each pool's log file gets at least this much room past its end, charged to the pool's
# tenant (about 16,000 commit records of room, and a checkpoint of ~40,000 blocks).
LOG_POOL_ROOM = 4 * MiB
CHECKPOINT_ROOM_FACTOR = 2  # a checkpoint is written beside the one it replaces; 2x: it grew
PAGE = 4096


class LogRooms:
    """The ``extra`` bytes (room above ``LOG_POOL_ROOM``) all pools' logs hold, against
    ``extra_limit`` (half the logs' share of the disk budget). Thread safety: the engine's
    thread only."""

    def __init__(self, extra_limit: int) -> None:
        self.extra_limit = extra_limit
        self.extra = 0

    def take(self, want: int) -> int:
        """Up to ``want`` extra bytes; returns what was given."""
        give = max(0, min(want, self.extra_limit - self.extra))
        self.extra += give
        return give

    def give_back(self, n: int) -> None:
        self.extra -= n


class LogRoom:
    """The room past the end of one pool's ``data.mdb``.

    Data structure: ``room`` the bytes kept past the end (``LOG_POOL_ROOM`` plus ``extra``
    taken from ``rooms``), ``reserved_end`` the offset the blocks are allocated up to.

    Invariants: the ledger holds ``LOG_POOL_ROOM`` for this pool's tenant while it is open
    (``charged``); ``extra`` is counted in ``rooms``.
    """

    def __init__(self, wal_file: str, tenant: str, ledger: BudgetLedger | None,
                 rooms: LogRooms) -> None:
        self.wal_file = wal_file
        self.tenant = tenant
        self.ledger = ledger  # None: no disk budget, no room kept
        self.rooms = rooms
        self.room = LOG_POOL_ROOM
        self.extra = 0
        self.reserved_end = 0
        self.charged = False
        self.refusals = 0  # reserves the filesystem refused (retried at the next ``keep``)
        self._unsupported = False

    def reserve(self) -> None:
        """Charge ``LOG_POOL_ROOM`` and allocate the room past the file's end (at open).

        Raises:
            BudgetExceededError: the disk budget cannot take it (nothing charged).
            NoSpaceError: the filesystem has no room for it (nothing charged).
        """
        if self.ledger is None:
            return
        self.ledger.charge(self.tenant, LOG_POOL_ROOM)
        try:
            self._reserve(os.stat(self.wal_file).st_size)
        except BaseException:
            self.ledger.release(self.tenant, LOG_POOL_ROOM)
            raise
        self.charged = True

    def keep(self, checkpoint_bytes: int | None = None) -> bool:
        """Reserve again once less than half the room is left past the end (the log grew), and
        size the room to ``checkpoint_bytes`` (the last checkpoint's, after one). Cheap: one
        ``stat`` unless it reserves. Returns False when the filesystem refused (a WARNING
        once per episode; retried at the next call), True otherwise."""
        if not self.charged or self._unsupported:
            return True
        grown = False
        if checkpoint_bytes is not None:
            want = -(-CHECKPOINT_ROOM_FACTOR * checkpoint_bytes // PAGE) * PAGE
            if want > self.room:
                got = self.rooms.take(want - self.room)
                self.extra += got
                self.room += got
                grown = got > 0
        try:
            size = os.stat(self.wal_file).st_size
        except OSError:
            return True  # the log is closed or moved: its owner reports that
        if not grown and not self.refusals and size + self.room // 2 <= self.reserved_end:
            return True
        try:
            self._reserve(size)
        except NoSpaceError as exc:
            if not self.refusals:
                log.warning("the log's room past its end cannot be kept: no space on its filesystem "
                            "(commits go on in the room left; retried) path=%s error=%s",
                            self.wal_file, exc)
            self.refusals += 1
            return False
        if self.refusals:
            log.info("the log's room past its end is kept again path=%s", self.wal_file)
            self.refusals = 0
        return True

    def _reserve(self, size: int) -> None:
        fd = os.open(self.wal_file, os.O_RDWR | os.O_CLOEXEC)
        try:
            falloc.reserve(fd, self.wal_file, 0, size + self.room)
        except falloc.PunchUnsupportedError as exc:
            log.warning("the log's room is not kept on this filesystem: %s", exc)
            self._unsupported = True
        finally:
            os.close(fd)
        self.reserved_end = size + self.room

    def release(self, punch: bool = False) -> None:
        """Give back the charge and the extra room (the pool closed); ``punch``: give the
        blocks past the file's end back to the filesystem too (the log is closed)."""
        if not self.charged:
            return
        self.charged = False
        self.ledger.release(self.tenant, LOG_POOL_ROOM)
        self.rooms.give_back(self.extra)
        self.extra, self.room = 0, LOG_POOL_ROOM
        if not punch or self._unsupported:
            return
        try:
            fd = os.open(self.wal_file, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            # NOTE: ext4 ignores a punch past the end, and frees blocks kept past the end on a
            # truncate to the same size; tmpfs does the opposite: both, so both give them back
            os.ftruncate(fd, size)
            end = -(-size // PAGE) * PAGE
            if self.reserved_end > end:
                falloc.punch(fd, self.wal_file, end, self.reserved_end - end)
        except (falloc.PunchUnsupportedError, StorageError, OSError) as exc:
            log.info("the closed log's room stays allocated path=%s error=%s", self.wal_file, exc)
        finally:
            os.close(fd)
            self.reserved_end = 0
