"""The daemon's malloc policy: freed message buffers stay in the heap for the next message.

The KV rpcs move messages of several MiB (a 2k-token tiny-llama prefix is 4 MiB; the limit is
``max_message_bytes``). glibc serves an allocation that large from ``mmap`` until it sees one
such chunk freed; then it raises its mmap threshold to that size and its trim threshold to
twice it (the dynamic ``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD``). A ReadKV reply holds two
buffers of its size at once on the loop thread (the framed ``bytes`` and gRPC's copy of them),
and freeing both leaves a free top of the heap past that trim threshold: glibc hands it back
to the OS, and the next reply faults every page of it in again, on the loop thread (about
two thousand faults for a 4 MiB ReadKV; none with the thresholds below).

NOTE (why fixed thresholds, and what they cost): setting either threshold turns glibc's
dynamic adjustment off, so both are set: allocations up to ``MMAP_THRESHOLD`` (glibc's
largest, 32 MiB on 64-bit) come from the heap, and up to ``TRIM_THRESHOLD`` of free memory at
its top is kept rather than returned: the daemon's RSS may stay up to that much above its
live data after a burst of large messages. An operator's own malloc settings win: with
``GLIBC_TUNABLES`` naming ``glibc.malloc`` or a ``MALLOC_*_`` variable set, nothing changes.

``heap_stats`` reads glibc's ``mallinfo2`` so that the kept memory shows: the metrics export
``prefixd_heap_free_bytes`` (free inside the heap: kept by the thresholds, or fragments
between live chunks) beside ``prefixd_heap_in_use_bytes``; the anonymous part of RSS less
the first is what the daemon's data holds (the fuzz soak checks that for flatness: over 100k calls RSS rose ~25 MiB
while the in-use bytes stayed within a few MiB, the rest free heap).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import NamedTuple

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 64 << 20  # twice it, as glibc's own adjustment would set
_OPERATOR_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")


def keep_message_buffers(environ=os.environ) -> bool:
    """Set glibc's mmap and trim thresholds for multi-MiB messages (see the module docstring).

    Returns:
        True if set; False when the operator set malloc's tunables in ``environ``, or the
        C library has no ``mallopt`` or refused the values (another libc than glibc).
    """
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", "") or any(v in environ for v in _OPERATOR_VARS):
        log.info("malloc thresholds left to the environment's settings")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("malloc thresholds not set (not glibc?): large messages may page-fault")
    return ok


class HeapStats(NamedTuple):
    """glibc's heap, from ``mallinfo2``: bytes in chunks handed out (``mmap``'d ones included)
    and bytes free inside the heap (not returned to the OS)."""

    in_use_bytes: int
    free_bytes: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    fn.argtypes = ()
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_stats() -> HeapStats | None:
    """The main process heap's use now, or None where the C library has no ``mallinfo2``.
    It walks malloc's free lists, so its cost grows with fragmentation: called once per
    scrape or ``Stats``, never per request."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return HeapStats(info.uordblks + info.hblkhd, info.fordblks)
