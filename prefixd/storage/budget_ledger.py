"""``BudgetLedger``: the bytes one tier's files hold, charged against the tier's budget and
each tenant's quota; one ledger is shared by every pool (tenant x layout) of that tier.

What is charged is what the files take (``st_blocks * 512``): a sparse pool file is charged
per extent it holds (``prefixd.storage.extents``), not per block in use, so the ledger's
``used_bytes`` and the filesystem agree.
"""

from __future__ import annotations

import threading
from typing import Iterable, NamedTuple

from prefixd.api.tiers import TIER_NAMES
from prefixd.config.budget_settings import Budget
from prefixd.storage.errors import BudgetExceededError


class Shortfall(NamedTuple):
    """What must be freed before a charge fits: ``own_bytes`` from the charging tenant's own
    blocks (it is at its ``max``), and ``total_bytes`` in all (own included) from blocks that
    ``may_evict`` allows."""

    own_bytes: int
    total_bytes: int


class BudgetLedger:
    """The bytes charged on one tier, by tenant, against ``capacity``.

    Data structure:
        ``capacity``: the tier's budget less ``log_reserve`` (the disk tier's room kept for
        the write-ahead log, taken first so that no pool can starve the log);
        ``_used[t]``: bytes charged to tenant ``t``; ``_max[t]`` (None: no cap) and
        ``_reserved[t]`` its quota; ``_footprint``: the sum over tenants of
        ``max(used, reserved)``, what the tier has promised (a tenant's unused reservation is
        promised to it, so it is not free for anyone else).

    Invariants (``check_invariants``):
        * ``used_bytes == sum(_used)``, every ``_used[t] >= 0``;
        * ``_footprint == sum(max(_used[t], _reserved[t]))`` and ``_footprint <= capacity``:
          whatever is charged, every tenant can still fill its reservation;
        * ``_used[t] <= _max[t]`` where there is a max.

    A tenant the ledger was not told of has no cap and no reservation.

    Thread safety: every method takes the ledger's lock: pools of one tier grow from several
    threads (the engine's loop, copy workers).

    NOTE: the check is paired with the mutation (``can_charge`` / ``charge``), and a charge
    that does not fit is refused whole, never partly made: a grow asks before it fallocates.
    """

    def __init__(self, tier: str, budget_bytes: int, *, log_reserve: int = 0,
                 tenants: Iterable[tuple[str, int | None, int]] = ()) -> None:
        """Args:
            tier: the tier's name (messages).
            budget_bytes: the tier's budget (``prefixd.config.Budget``).
            log_reserve: bytes kept out of the budget for the log (disk tier).
            tenants: ``(name, max or None, reserved)`` of each tenant with a quota here.
        Raises:
            ValueError: negative sizes, a reservation above its max, or reservations (with the
                log's room) above the budget.
        """
        if budget_bytes < 0 or log_reserve < 0:
            raise ValueError(f"{tier}: budget and log reserve must be >= 0, got {budget_bytes}, "
                             f"{log_reserve}")
        self.tier = tier
        self.capacity = budget_bytes - log_reserve
        self.log_reserve = log_reserve
        self._max: dict[str, int | None] = {}
        self._reserved: dict[str, int] = {}
        self._used: dict[str, int] = {}
        self.used_bytes = 0
        self._footprint = 0
        self._lock = threading.Lock()
        for name, cap, reserved in tenants:
            if reserved < 0 or (cap is not None and (cap < 0 or reserved > cap)):
                raise ValueError(f"{tier}: tenant {name!r} reserves {reserved} bytes with a max "
                                 f"of {cap}")
            self._max[name], self._reserved[name], self._used[name] = cap, reserved, 0
            self._footprint += reserved
        if self._footprint > self.capacity:
            raise ValueError(f"{tier}: reservations of {self._footprint} bytes do not fit the "
                             f"budget of {budget_bytes} bytes less the log's {log_reserve}")

    @classmethod
    def for_tier(cls, budget: Budget, tier: str, log_reserve: int = 0) -> "BudgetLedger":
        """The ledger of ``tier`` (``"device"``, ``"host"``, ``"disk"``) of a resolved budget,
        with every tenant's quota there.

        Raises:
            ValueError: see ``__init__``.
        """
        i = TIER_NAMES.index(tier)
        return cls(tier, budget.bytes_of(tier), log_reserve=log_reserve,
                   tenants=[(t.name, t.max[i], t.reserved[i]) for t in budget.tenants])

    # -- queries ------------------------------------------------------------------------------

    def used_by(self, tenant: str) -> int:
        return self._used.get(tenant, 0)

    def by_tenant(self) -> dict[str, int]:
        """Bytes charged per tenant (every tenant with a quota, and every one ever charged)."""
        with self._lock:
            return dict(self._used)

    @property
    def free_bytes(self) -> int:
        """Bytes no one has: neither charged nor promised to a reservation."""
        return self.capacity - self._footprint

    def _after(self, tenant: str, delta: int) -> int:
        """``_footprint`` once ``tenant`` is charged ``delta`` more bytes."""
        used, reserved = self._used.get(tenant, 0), self._reserved.get(tenant, 0)
        return self._footprint - max(used, reserved) + max(used + delta, reserved)

    def _fits(self, tenant: str, n: int) -> bool:
        cap = self._max.get(tenant)
        if cap is not None and self._used.get(tenant, 0) + n > cap:
            return False
        return self._after(tenant, n) <= self.capacity

    def available(self, tenant: str) -> int:
        """The most ``tenant`` may be charged now: within its max, without the bytes promised
        to other tenants' reservations (its own unused reservation included)."""
        with self._lock:
            used, reserved = self._used.get(tenant, 0), self._reserved.get(tenant, 0)
            room = self.capacity - self._footprint + max(0, reserved - used)
            cap = self._max.get(tenant)
            if cap is not None:
                room = min(room, cap - used)
            return max(0, room)

    def can_charge(self, tenant: str, n_bytes: int) -> bool:
        """Whether ``tenant`` may take ``n_bytes`` more: under its max, and without the bytes
        promised to other tenants' reservations."""
        with self._lock:
            return self._fits(tenant, n_bytes)

    def shortfall(self, tenant: str, n_bytes: int) -> Shortfall:
        """What eviction must free before ``charge(tenant, n_bytes)`` fits (zeros if it fits)."""
        with self._lock:
            cap = self._max.get(tenant)
            own = 0 if cap is None else max(0, self._used.get(tenant, 0) + n_bytes - cap)
            return Shortfall(own, max(own, self._after(tenant, n_bytes) - self.capacity))

    def may_evict(self, victim: str, n_bytes: int, for_tenant: str) -> bool:
        """Whether evicting ``n_bytes`` of ``victim``'s makes room for ``for_tenant``: its own
        blocks always may go; another tenant's only above its reservation (reserved bytes of
        A are never available to B)."""
        with self._lock:
            if victim == for_tenant:
                return True
            return self._used.get(victim, 0) - n_bytes >= self._reserved.get(victim, 0)

    # -- mutations ----------------------------------------------------------------------------

    def charge(self, tenant: str, n_bytes: int) -> None:
        """Charge ``n_bytes`` to ``tenant``.

        Raises:
            BudgetExceededError: it does not fit (see ``can_charge``); nothing is charged.
            ValueError: ``n_bytes`` < 0.
        """
        if n_bytes < 0:
            raise ValueError(f"cannot charge {n_bytes} bytes")
        with self._lock:
            if not self._fits(tenant, n_bytes):
                raise BudgetExceededError(
                    f"the {self.tier} budget cannot take {n_bytes} more bytes for tenant "
                    f"{tenant!r}: it holds {self.used_bytes} of {self.capacity} "
                    f"(tenant {self._used.get(tenant, 0)}, max {self._max.get(tenant)}); "
                    f"raise [engine.budget] {self.tier} or the tenant's max")
            self._footprint = self._after(tenant, n_bytes)
            self._used[tenant] = self._used.get(tenant, 0) + n_bytes
            self.used_bytes += n_bytes

    def release(self, tenant: str, n_bytes: int) -> None:
        """Give back ``n_bytes`` charged to ``tenant``.

        Raises:
            ValueError: more than ``tenant`` holds, or ``n_bytes`` < 0 (a caller bug).
        """
        with self._lock:
            held = self._used.get(tenant, 0)
            if n_bytes < 0 or n_bytes > held:
                raise ValueError(f"{self.tier}: tenant {tenant!r} releases {n_bytes} bytes but "
                                 f"holds {held}")
            self._footprint = self._after(tenant, -n_bytes)
            self._used[tenant] = held - n_bytes
            self.used_bytes -= n_bytes

    def check_invariants(self) -> None:
        with self._lock:
            assert all(u >= 0 for u in self._used.values()), f"negative charge: {self._used}"
            assert self.used_bytes == sum(self._used.values()), "used_bytes drifted"
            names = set(self._used) | set(self._reserved)
            footprint = sum(max(self._used.get(n, 0), self._reserved.get(n, 0)) for n in names)
            assert self._footprint == footprint, "footprint drifted"
            assert self._footprint <= self.capacity, \
                f"{self.tier}: {self._footprint} bytes promised, capacity {self.capacity}"
            for name, cap in self._max.items():
                assert cap is None or self._used[name] <= cap, f"tenant {name!r} above its max"
