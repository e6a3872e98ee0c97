"""Errors raised by the storage tiers, each carrying what a person needs to act on it."""

from __future__ import annotations


class StorageError(Exception):
    """Base class: something about a pool's memory or files is wrong."""


class SpaceError(StorageError):
    """A pool could not be allocated: too little space where its file lives.

    Attributes:
        path: the file that was being allocated.
        needed_bytes: how many bytes the pool asked for.
        free_bytes: how many bytes the filesystem said were free (``None`` if unknown).
    """

    def __init__(self, path: str, needed_bytes: int, free_bytes: int | None, detail: str = "") -> None:
        self.path = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        free = "unknown" if free_bytes is None else f"{free_bytes} bytes ({_mib(free_bytes)})"
        msg = (
            f"cannot allocate pool file {path}: asked for {needed_bytes} bytes "
            f"({_mib(needed_bytes)}), free on its filesystem: {free}"
        )
        if detail:
            msg += f" ({detail})"
        msg += "; lower the tier's num_blocks or free space there"
        super().__init__(msg)


class HeaderMismatchError(StorageError):
    """An existing pool file belongs to another format version, layout, tier or file id.

    Opening it would serve one model's KV to another, so it is refused. The message names the
    field, what was expected and what the file holds.
    """


class PoolFileMissingError(StorageError):
    """A pool file that the caller saved the id of (so it must exist) is gone.

    Creating it afresh under that id would make an empty file look like the one the caller's
    index describes, and every block the index names in it would be lost on use, silently. The
    caller decides: refuse, or forget those blocks and open the pool without the id.

    Attributes:
        path: the missing file.
    """

    def __init__(self, path: str, file_id: bytes) -> None:
        self.path = path
        super().__init__(
            f"pool file {path} (file id {file_id.hex()}) is missing: the blocks it held are gone; "
            "put the file back, or open the pool without its saved file id to start it empty"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class NoSpaceError(StorageError):
    """A grow of a pool file met ENOSPC or EDQUOT: the filesystem (or the quota) has no room
    for the bytes asked, although the budget had. The caller treats it as "no room" (evict,
    or serve from another tier), never as a crash; nothing was charged to the budget.

    Attributes:
        path: the file that was growing.
        needed_bytes: the bytes asked for.
    """

    def __init__(self, path: str, needed_bytes: int, detail: str = "") -> None:
        self.path = path
        self.needed_bytes = needed_bytes
        super().__init__(f"no room to grow {path} by {needed_bytes} bytes ({_mib(needed_bytes)})"
                         + (f": {detail}" if detail else "")
                         + "; free space on its filesystem, or lower the tier's budget below "
                           "what the filesystem holds")


class BudgetExceededError(StorageError):
    """A charge that does not fit its tier's budget (or its tenant's max, or would take
    another tenant's reserved bytes): the caller charges only after ``can_charge``."""
