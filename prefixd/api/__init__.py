"""The API contract: the KV layout and the tier vocabulary every part agrees on (and, with the
daemon, prefixd.proto)."""

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import Tier

__all__ = ["KVLayout", "Tier"]
