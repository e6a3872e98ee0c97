"""The API contract: the KV layout every part agrees on (and, with the daemon, prefixd.proto)."""

from prefixd.api.layout import KVLayout

__all__ = ["KVLayout"]
