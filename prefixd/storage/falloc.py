"""Giving a file's space and taking it back: ``allocate`` (fallocate mode 0) and ``punch``
(``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``), for the sparse pool files
(``prefixd.storage.extents``).

``os`` has ``posix_fallocate`` but no ``fallocate`` with a mode, so ``punch`` calls libc's
``fallocate`` through ctypes (Linux; ext4, xfs, btrfs and tmpfs all punch holes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from prefixd.storage.errors import NoSpaceError, StorageError

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_fallocate = getattr(_libc, "fallocate64", None) or getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


class PunchUnsupportedError(StorageError):
    """The file's filesystem cannot punch holes: its extents are kept (and stay charged)."""


def allocate(fd: int, path: str, offset: int, length: int) -> None:
    """Give ``[offset, offset + length)`` of the file its blocks, so that no later write or
    mapped store there can fail for space (zeros where nothing was written; data kept).

    Raises:
        NoSpaceError: ENOSPC, EDQUOT or EFBIG (the path and the bytes asked).
        StorageError: any other error.
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise NoSpaceError(path, length, os.strerror(exc.errno)) from exc
        raise StorageError(f"fallocate of {length} bytes at offset {offset} of {path} "
                           f"failed: {exc}") from exc


def reserve(fd: int, path: str, offset: int, length: int) -> None:
    """Give ``[offset, offset + length)`` its blocks without changing the file's size
    (``FALLOC_FL_KEEP_SIZE``): a file that grows by writes (LMDB's ``data.mdb``) then grows
    into blocks it already has, so those writes cannot meet ENOSPC.

    Raises:
        NoSpaceError: ENOSPC, EDQUOT or EFBIG (the path and the bytes asked).
        PunchUnsupportedError: no fallocate with a mode here (libc or filesystem).
        StorageError: any other error.
    """
    if _fallocate is None:
        raise PunchUnsupportedError(f"libc has no fallocate: cannot reserve room in {path}")
    if _fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    err = ctypes.get_errno()
    if err in _NO_SPACE:
        raise NoSpaceError(path, length, os.strerror(err))
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise PunchUnsupportedError(f"the filesystem of {path} cannot reserve room "
                                    f"({os.strerror(err)})")
    raise StorageError(f"reserving {length} bytes at offset {offset} of {path} failed: "
                       f"{os.strerror(err)}")


def punch(fd: int, path: str, offset: int, length: int) -> None:
    """Give back the blocks of ``[offset, offset + length)``; the size stays and the range
    reads as zeros.

    Raises:
        PunchUnsupportedError: the filesystem (or libc) cannot punch holes.
        StorageError: any other error.
    """
    if _fallocate is None:
        raise PunchUnsupportedError(f"libc has no fallocate: cannot punch holes in {path}")
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise PunchUnsupportedError(f"the filesystem of {path} cannot punch holes "
                                    f"({os.strerror(err)})")
    raise StorageError(f"punching {length} bytes at offset {offset} of {path} failed: "
                       f"{os.strerror(err)}")


def held_bytes(fd: int) -> int:
    """The bytes the file's blocks take (``st_blocks * 512``): what its budget is charged."""
    return os.fstat(fd).st_blocks * 512
