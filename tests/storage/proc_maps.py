"""What this process has mapped, read from ``/proc/self/smaps`` (Linux): tests that a mapping
is populated at map time, not faulted in page by page on the serving path."""

from __future__ import annotations

import mmap
import os

import pytest

HAS_POPULATE = hasattr(mmap, "MAP_POPULATE") and os.path.exists("/proc/self/smaps")


def resident_bytes(path: str) -> int:
    """Resident bytes (``Rss``) of this process's mappings of ``path``, summed."""
    path = os.path.realpath(path)
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                mine = len(head) == 6 and head[5].strip() == path
            elif mine and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def need_populate() -> None:
    if not HAS_POPULATE:
        pytest.skip("MAP_POPULATE and /proc/self/smaps are Linux's")
