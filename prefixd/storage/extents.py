"""``SparsePoolFile``: a pool file as large as its tier's budget that takes disk or memory
only for the extents that hold blocks.

The file is created at its full size (``num_slots`` up to the tier's budget) as a hole; extents
(``EXTENT_BYTES``, see ``prefixd.storage.extent_map``) get their blocks with fallocate before
any slot in them is handed out, and give them back with ``FALLOC_FL_PUNCH_HOLE`` once every
slot in them is free. Clients map the whole range once: a mapping costs address space, not
memory, so a pool that grows or shrinks never makes them remap.

Every byte it holds is charged to its tier's ``BudgetLedger`` under its tenant, extent by
extent, so ``ledger.used_bytes`` is what the tier's files take (``st_blocks * 512``).

The shm and disk pools (``prefixd.storage.pools``) are files of this kind; their slots are
handed out by ``prefixd.storage.extent_slots.ExtentSlotAllocator``, which calls ``take``,
``give_back``, ``shrink`` and ``recover`` in the order below.
"""

from __future__ import annotations

import logging
import os

from prefixd.crashpoints import crash_point
from prefixd.storage import falloc, poolfile
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import BudgetExceededError, NoSpaceError
from prefixd.storage.extent_map import PAGE, ExtentMap
from prefixd.storage.poolfile import PoolHeader

log = logging.getLogger(__name__)

EXTENT_BYTES = 2 << 20  # see docs/design.md, "Sparse pool files": fallocate cost vs. slack


class SparsePoolFile:
    """One sparse pool file, its extents (``extent_map``) and its charge in the ledger.

    The write order (the crash-safety contract of growing and shrinking):

    * grow, ``take(slots)``: every missing extent the slots touch is charged to the ledger,
      fallocated, and (``durable``: a disk file) the file fsynced, BEFORE the slots are handed
      out; only then may anything be written to them, through a mapping or ``pwrite``. A grown
      extent therefore never meets ENOSPC later, and a tmpfs store never SIGBUSes.
    * shrink, ``give_back(slots)`` then ``shrink()``: free before reuse. ``give_back`` is called
      only once the WAL record that frees the slots has committed (when the slot allocator's
      quarantine releases them), so an extent is punched only when no committed record names a
      block in it. A crash between the commit and the punch leaves an extent allocated and
      idle: ``recover`` punches it.
    * recovery, ``recover(used_slots)`` right after opening: the extents of the slots the
      recovered index names are allocated (a hole there, from a punch the index did not expect,
      becomes zeros, whose checksum fails: the block is dropped, never served), every other
      extent is punched, and the ledger is charged for what is held.

    Invariants (``check_invariants``): the extent map's; ``charged`` equals
    ``extent_map.held_bytes``.

    Thread safety: none of its own; the engine calls it from the one thread that owns the
    pool's slot allocators. The ledger it charges is shared and locked.

    NOTE: a punched extent read through a shm mapping faults in fresh zero pages, which tmpfs
    allocates; the engine never reads a slot it has not handed out, so only a verification of a
    block that was wrongly punched does, and that block is dropped.
    """

    def __init__(self, path: str, header: PoolHeader, *, ledger: BudgetLedger, tenant: str,
                 durable: bool, fresh: bool = False, expect_file_id: bool = False,
                 extent_bytes: int = EXTENT_BYTES) -> None:
        """Create (``fresh``, or no file) or open the file; charge its header's extent.

        Args:
            header: the pool's header (``num_slots`` sized to the tier's budget).
            ledger, tenant: who is charged.
            durable: fsync after each grow (a disk file: its allocation survives power loss).
            expect_file_id: check ``header.file_id`` against an existing file's.
        Raises:
            BudgetExceededError: the header's extent does not fit the budget.
            SpaceError, NoSpaceError: the filesystem cannot hold the header's extent (a new
                file, an existing one).
            HeaderMismatchError: an existing file is another pool's.
        """
        self.path = path
        self.ledger = ledger
        self.tenant = tenant
        self.durable = durable
        self.extent_map = ExtentMap(header.data_offset, header.block_bytes, header.num_slots,
                                    extent_bytes)
        self.charged = 0
        self._punch_ok = True
        self.on_grow = None  # called with (offset, length) of each run of extents grown
        first = self.extent_map.charge(0)
        ledger.charge(tenant, first)
        try:
            if fresh or not os.path.exists(path):
                self.fd = poolfile.create_pool_file(path, header, allocate_bytes=first)
                self.header = header
            else:
                self.fd, self.header = poolfile.open_pool_file(path, header, expect_file_id,
                                                               sparse=True)
                # the header's extent is held from here on; a file cut short behind our back
                # lost part of it, and a later write there must not meet ENOSPC
                try:
                    falloc.allocate(self.fd, path, *self.extent_map.byte_range(0))
                except BaseException:
                    os.close(self.fd)
                    raise
        except BaseException:
            ledger.release(tenant, first)
            raise
        self.charged = first
        self.file_id = self.header.file_id

    # -- grow ---------------------------------------------------------------------------------

    def take(self, slots, touched: dict[int, int] | None = None) -> bool:
        """Make ``slots`` usable and count them in use: grow every extent they touch first.
        ``touched``: ``extent_map.touched(slots)``, when the caller has it.

        Returns:
            False, with nothing taken or charged, when the budget has no room for the
            extents to grow (the caller evicts and asks again).
        Raises:
            NoSpaceError: the filesystem had no room (ENOSPC, EDQUOT); nothing is taken, and
                only extents that were allocated stay charged (idle: ``shrink`` gives them
                back). The caller treats it as "no room", never as a crash.
            ValueError: a slot out of range.
        """
        em = self.extent_map
        touched = em.touched(slots) if touched is None else touched
        missing = em.missing(touched=touched)
        if missing and not self._grow(missing):
            return False
        em.add_users(touched=touched)
        return True

    def _grow(self, extents: list[int]) -> bool:
        """Charge, then fallocate ``extents`` (ascending) one run of neighbours per call: a
        recovery's thousands of extents are a few calls. A run that fails is punched again
        (a filesystem may keep part of a failed fallocate) and is not charged."""
        em = self.extent_map
        need = sum(em.charge(k) for k in extents)
        try:
            self.ledger.charge(self.tenant, need)
        except BudgetExceededError:
            return False
        done = 0
        try:
            for run in _runs(extents):
                offset = em.byte_range(run[0])[0]
                end = sum(em.byte_range(run[-1]))
                try:
                    falloc.allocate(self.fd, self.path, offset, end - offset)
                except NoSpaceError:
                    _punch_quietly(self.fd, self.path, offset, end - offset)
                    raise
                for k in run:
                    em.mark_allocated(k)
                    done += em.charge(k)
                if self.on_grow is not None:
                    self.on_grow(offset, end - offset)
            if self.durable:
                os.fsync(self.fd)
        except BaseException:
            self.ledger.release(self.tenant, need - done)
            self.charged += done
            raise
        self.charged += need
        crash_point("extent_grown")
        return True

    # -- shrink -------------------------------------------------------------------------------

    def give_back(self, slots, touched: dict[int, int] | None = None) -> None:
        """Count ``slots`` no longer in use. Call only once no committed record names them
        (free before reuse: see the class docstring). ``touched``: as for ``take``.

        Raises ValueError: a slot out of range."""
        self.extent_map.add_users(slots, -1, touched=touched)

    def shrink(self, keep_idle: int = 0) -> int:
        """Punch idle extents (no slot in use), keeping the ``keep_idle`` lowest ones allocated
        (a pool about to grow again need not fallocate them anew); returns the bytes given
        back. A filesystem that cannot punch keeps its extents (charged), logged once.

        Raises:
            StorageError: a punch failed for another reason.
        """
        if not self._punch_ok:
            return 0
        freed = 0
        em = self.extent_map
        for k in em.idle()[keep_idle:]:
            em.require_idle(k)
            try:
                # whole pages: a partial last page would be zeroed, not given back
                falloc.punch(self.fd, self.path, em.byte_range(k)[0], em.charge(k))
            except falloc.PunchUnsupportedError as exc:
                log.warning("pool file cannot shrink, extents stay allocated path=%s err=%s",
                            self.path, exc)
                self._punch_ok = False
                break
            crash_point("extent_punched")
            n = em.charge(k)
            em.mark_punched(k)
            self.ledger.release(self.tenant, n)
            self.charged -= n
            freed += n
        return freed

    # -- recovery -----------------------------------------------------------------------------

    def recover(self, used_slots) -> None:
        """After opening an existing file: hold the extents of ``used_slots`` (the slots the
        recovered index names, quarantined ones included), punch every other one, and charge
        what is held. Call once, before any ``take``.

        Raises:
            BudgetExceededError: the extents of ``used_slots`` do not fit the budget (nothing
                charged; ``extent_map.bytes_for`` lets the caller pick the blocks that fit).
            NoSpaceError: the filesystem cannot hold them.
        """
        em = self.extent_map
        if em.num_users or self.charged != em.charge(0):
            raise ValueError(f"recover({self.path}) must come right after opening the file")
        if not self.take(used_slots):
            raise BudgetExceededError(
                f"{self.path}: its recovered blocks need {em.bytes_for(used_slots)} bytes of the "
                f"{self.ledger.tier} budget, which has {self.ledger.free_bytes} free")
        # every run of extents no recovered slot touches is punched in one call (a run that is
        # a hole already costs nothing more): a crash between a free's commit and its punch,
        # or between a grow and its use, leaves no charge that the ledger does not see
        start = None
        for k in range(1, em.num_extents + 1):
            hole = k < em.num_extents and not em.is_allocated(k)
            if hole and start is None:
                start = k
            elif not hole and start is not None:
                offset = em.byte_range(start)[0]
                end = min(k * em.extent_bytes, -(-em.file_bytes // PAGE) * PAGE)
                start = None
                try:
                    falloc.punch(self.fd, self.path, offset, end - offset)
                except falloc.PunchUnsupportedError as exc:
                    log.warning("pool file cannot shrink, extents stay allocated path=%s err=%s",
                                self.path, exc)
                    self._punch_ok = False
                    return

    # -- queries and lifecycle ----------------------------------------------------------------

    def held_bytes(self) -> int:
        """What the file takes on its filesystem (``st_blocks * 512``)."""
        return falloc.held_bytes(self.fd)

    def close(self) -> None:
        """Close the file and release its whole charge. Its bytes stay in the file: close a
        pool after ``shrink`` (with no slot in use only the header's extent is left), or
        ``unlink`` it. Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.ledger.release(self.tenant, self.charged)
            self.charged = 0

    def unlink(self) -> None:
        """Close and remove the file (a pool with no session and no cached block)."""
        self.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
            poolfile.fsync_dir(os.path.dirname(self.path) or ".")

    def check_invariants(self) -> None:
        self.extent_map.check_invariants()
        if self.fd >= 0:
            assert self.charged == self.extent_map.held_bytes, \
                f"charged {self.charged} != held by the map {self.extent_map.held_bytes}"


def _runs(extents: list[int]) -> list[list[int]]:
    """Ascending ``extents`` cut into runs of neighbours: ``[1, 2, 3, 7, 8] -> [[1, 2, 3], [7, 8]]``."""
    runs: list[list[int]] = []
    for k in extents:
        if runs and runs[-1][-1] == k - 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def _punch_quietly(fd: int, path: str, offset: int, length: int) -> None:
    """Give back what a failed fallocate may have left; a failure here only leaves bytes the
    next recovery punches."""
    try:
        falloc.punch(fd, path, offset, length)
    except Exception:  # noqa: BLE001 - best effort on an error path that already raises
        log.warning("could not give back a failed grow path=%s offset=%d", path, offset)
