"""The cache core: block identity, the radix tree, sequences, refcounts, eviction, events.

In-process and free of I/O: byte movement is delegated to ``prefixd.storage`` and durability
to the engine that drains ``PrefixCache.events`` into the WAL.
"""

from prefixd.cache.errors import CacheError, InvalidTokens, OutOfBlocks, UnknownSequence
from prefixd.cache.lookup import LookupResult
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.cache.sequence import Sequence

__all__ = ["CacheError", "InvalidTokens", "LookupResult", "OutOfBlocks", "PrefixCache",
           "Sequence", "UnknownSequence"]
