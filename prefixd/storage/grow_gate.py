"""Growing a sparse pool file for the slots an allocation hands out, and remembering refusals.

``GrowGate`` is the part of ``prefixd.storage.extent_slots.ExtentSlotAllocator`` that asks
``SparsePoolFile.take`` to grow the extents a batch of slots touches. A grow the ledger refuses
(``take`` returns False) or the filesystem refuses (``NoSpaceError``: ENOSPC, EDQUOT) is counted
and remembered: until room may be back (the ledger can charge an extent again, or
``NO_SPACE_RETRY_S`` passed since the filesystem refused) the allocator counts only the free
slots in held extents as free.
"""

from __future__ import annotations

import logging
import time

from prefixd.storage.errors import NoSpaceError
from prefixd.storage.extents import SparsePoolFile

log = logging.getLogger(__name__)

NO_SPACE_RETRY_S = 1.0  # after ENOSPC, grows are tried again at most this often


class GrowGate:
    """Grows of one sparse pool file, and the refusals met (see the module docstring).

    Thread safety: none; its allocator's owner calls it (one thread).
    """

    def __init__(self, pool_file: SparsePoolFile) -> None:
        self.file = pool_file
        self.grow_refusals = 0  # grows refused, by the ledger or the filesystem
        self.no_space_refusals = 0  # ... by the filesystem (ENOSPC, EDQUOT)
        self.out_of_space = False  # the last grow tried met ENOSPC or EDQUOT
        self._refused_at: float | None = None  # when a grow was last refused (None: not since)
        self._refused_no_space = False

    def refused(self) -> bool:
        """Whether a refused grow still stands (room not back yet); clears it once room may
        be back, so the next allocation tries again."""
        if self._refused_at is None:
            return False
        if self._refused_no_space:
            back = time.monotonic() - self._refused_at >= NO_SPACE_RETRY_S
        else:
            f = self.file
            back = f.ledger.can_charge(f.tenant, f.extent_map.extent_bytes)
        if back:
            self._refused_at = None
        return not back

    def grow(self, slots: list[int], counts: dict[int, int]) -> bool:
        """Grow the extents ``slots`` touch (``counts``: users per extent) before they are
        handed out; False, counted as a refusal, when the ledger or the filesystem refuses."""
        try:
            if not self.file.take(slots, touched=counts):
                self._refuse(False)
                return False
        except NoSpaceError as exc:
            if not self.out_of_space:
                log.info("pool file cannot grow, the filesystem is full: %s", exc)
            self.no_space_refusals += 1
            self.out_of_space = True
            self._refuse(True)
            return False
        if self.out_of_space:
            log.info("pool file grows again path=%s", self.file.path)
            self.out_of_space = False
        return True

    def _refuse(self, no_space: bool) -> None:
        self.grow_refusals += 1
        self._refused_at = time.monotonic()
        self._refused_no_space = no_space
