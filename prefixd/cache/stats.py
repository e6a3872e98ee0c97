"""The cache core's counters (the daemon exports them as metrics)."""

from __future__ import annotations


class CacheStats:
    """Counters (the daemon exports them as metrics)."""

    __slots__ = ("requested_tokens", "hit_tokens", "opens", "evicted_blocks", "evict_ns",
                 "cow_blocks", "committed_blocks", "corrupt_blocks", "requested_blocks",
                 "hit_tokens_by_tier", "evicted_by_tier", "demoted_by_tier", "promoted_by_tier")

    _BY_TIER = ("hit_tokens_by_tier", "evicted_by_tier", "demoted_by_tier", "promoted_by_tier")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
        self.hit_tokens_by_tier = [0, 0, 0]  # promoted from host [1] / disk [2]; [0] unused
        # blocks, indexed by the tier they left: evicted (slots freed there), demoted (copied
        # down before an eviction), promoted (copied up to the device on a hit)
        self.evicted_by_tier = [0, 0, 0]
        self.demoted_by_tier = [0, 0, 0]
        self.promoted_by_tier = [0, 0, 0]

    def absorb(self, other: "CacheStats") -> None:
        """Add ``other``'s counts to these (a pool opened again carries on its closed counts,
        so the counters the daemon exports never go down)."""
        for name in self.__slots__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, list):
                setattr(self, name, [a + b for a, b in zip(mine, theirs)])
            else:
                setattr(self, name, mine + theirs)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        for name in self._BY_TIER[1:]:
            out[name] = dict(zip(("device", "host", "disk"), getattr(self, name)))
        _, host, disk = self.hit_tokens_by_tier
        out["hit_tokens_by_tier"] = {"device": self.hit_tokens - host - disk, "host": host, "disk": disk}
        return out | {"hit_rate": self.hit_rate}
