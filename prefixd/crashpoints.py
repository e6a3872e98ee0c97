"""Named crash points for crash testing.

``PREFIXD_CRASH="name:n[,name:n...]"`` makes the process ``os._exit(CRASH_EXIT_CODE)`` at the
n-th pass (1-based) of ``crash_point(name)``. Unset (production), ``crash_point`` is one dict
lookup on an empty dict. The variable is read once, at import.

Every point, one call site each (``tests/test_crashpoints.py`` checks that this list, the
call sites and the kill -9 suite agree):

- ``disk_data_written``: storage, a batch of blocks pwritten to the disk pool, not yet synced.
- ``disk_data_synced``: storage, the disk pool fdatasynced after writes.
- ``commit_data_written``: engine commit, the blocks copied down, records not yet appended.
- ``commit_data_synced``: engine, the disk pool synced before records that name its slots.
- ``checkpoint_dumped``: engine, the checkpoint serialized, not yet handed to the log.
- ``wal_checkpoint_inside``: log, inside the checkpoint's write transaction.
- ``wal_before_commit``, ``wal_after_commit``: log, around a group's commit.
- ``evict_inside``, ``promote_inside``: cache core, in the middle of an eviction / promotion.
- ``extent_grown``: storage, a sparse pool file's extents fallocated (and fsynced), before the
  slots in them are handed out.
- ``extent_punched``: storage, one idle extent of a sparse pool file punched, before its
  charge is released.

NOTE: a name belongs to one site: an armed ``name:n`` counts passes, and passes of two sites
under one name would make ``n`` mean nothing in particular.
"""

from __future__ import annotations

import os

CRASH_EXIT_CODE = 77


def _parse(spec: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, n = item.partition(":")
        points[name] = int(n or 1)
    return points


_armed = _parse(os.environ.get("PREFIXD_CRASH", ""))
_passes: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Die here, without cleanup, if this point is armed and this is its n-th pass."""
    if not _armed or name not in _armed:
        return
    count = _passes.get(name, 0) + 1
    _passes[name] = count
    if count == _armed[name]:
        os._exit(CRASH_EXIT_CODE)


def arm(spec: str) -> None:
    """Re-arm from a spec string (tests in a child process call this instead of the env)."""
    global _armed
    _armed = _parse(spec)
    _passes.clear()
