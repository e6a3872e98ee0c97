"""The tier vocabulary every part shares: device, host, disk.

``Tier`` is the enum for interfaces (descriptors, storage calls, stats); ``DEVICE``, ``HOST``
and ``DISK`` are the same values as plain ints, which the cache core uses to index per-tier
lists on its hot path (an ``IntEnum`` index costs a lookup of ``__index__`` each time).
"""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


DEVICE, HOST, DISK = 0, 1, 2
NUM_TIERS = 3
TIER_NAMES = ("device", "host", "disk")

__all__ = ["DEVICE", "DISK", "HOST", "NUM_TIERS", "TIER_NAMES", "Tier"]
