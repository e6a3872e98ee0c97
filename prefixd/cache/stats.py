"""The cache core's counters (the daemon exports them as metrics)."""

from __future__ import annotations


class CacheStats:
    """Counters (the daemon exports them as metrics)."""

    __slots__ = ("requested_tokens", "hit_tokens", "opens", "evicted_blocks", "evict_ns",
                 "cow_blocks", "committed_blocks", "corrupt_blocks", "hit_tokens_by_tier")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
        self.hit_tokens_by_tier = [0, 0, 0]  # promoted from host [1] / disk [2]; [0] unused

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        _, host, disk = self.hit_tokens_by_tier
        out["hit_tokens_by_tier"] = {"device": self.hit_tokens - host - disk, "host": host, "disk": disk}
        return out | {"hit_rate": self.hit_rate}
