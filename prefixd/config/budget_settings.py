"""Byte budgets: how much GPU memory, host memory and disk the whole daemon may take.

The engine resolves them at start (``prefixd.engine.budgets``) and every pool (tenant x layout)
draws from them; the config file says it per tier, for every pool together::

    [engine.budget]
    device = "24GiB"       # a size (prefixd.config.sizes) or a percentage
    host = "50%"           # of MemTotal (/proc/meminfo)
    disk = "2TiB"          # a percentage: of the state directory's filesystem size (statvfs)

    [[engine.tenants]]
    name = "acme"
    max = { host = "8GiB", disk = "50%" }     # the most this tenant's blocks may take
    reserved = { host = "1GiB" }              # bytes other tenants' blocks never take from it

``BudgetSpec`` and ``Quota`` hold what was written (``Size``s, validated when built), a
``TenantQuota`` one tenant's ``max`` and ``reserved``; ``Budget`` holds bytes, resolved against a
``Machine`` (what is there) once, when the daemon starts.

Percentages: ``device`` of the GPU's memory, or, on a host without a GPU (the device tier is then
a shm-backed CPU tensor), of MemTotal, the memory that backs shm; ``host`` of MemTotal; ``disk``
of the state directory's filesystem (its size, not what is free: a budget that changes when
another process writes a file is not a budget). A tenant's percentage is of the same total as
the tier's.

Defaults (a key left out), safe on a laptop and on a shared host:

- ``host``: min(10% of MemTotal, 4 GiB);
- ``disk``: min(10% of the filesystem, 32 GiB);
- ``device``: on a GPU, min(5% of its memory, 4 GiB) (vLLM takes 90% of a GPU by default and
  its activations need most of the rest); without a GPU, the ``host`` rule (the device tier is
  host memory then).

A budget of ``0`` turns a tier off; ``device`` cannot be 0 (it serves every request) and
``host`` and ``disk`` cannot both be (device blocks do not survive a restart).

Checks: a tenant's ``reserved`` above its ``max`` on a tier, or the tenants' reservations on a
tier adding up to more than the tier's budget, is a ``ConfigError`` naming the keys. What can
be decided from the file alone (sizes against sizes, percentages against percentages, a size
against a default's cap) is checked when the config is built; the rest when ``Budget.resolve``
knows the machine, at the daemon's start.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping

from prefixd.api.tiers import TIER_NAMES
from prefixd.config.errors import ConfigError
from prefixd.config.sizes import Size, format_bytes

GiB = 1 << 30
# (share of the total in percent, cap in bytes) of each default
DEFAULT_HOST = (10.0, 4 * GiB)
DEFAULT_DISK = (10.0, 32 * GiB)
DEFAULT_GPU_DEVICE = (5.0, 4 * GiB)


def _sizes(owner: object, where: str, keys: Iterable[str]) -> None:
    for tier in keys:
        value = getattr(owner, tier)
        if value is not None:
            object.__setattr__(owner, tier, Size.parse(f"{where}.{tier}", value))


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
    """``[engine.budget]`` as written: a ``Size`` per tier, or None for the default.

    Strings and ints given here are parsed (``BudgetSpec(host="8GiB")``).

    Raises:
        ConfigError: a value that is not a size, ``device = 0``, or both ``host`` and ``disk``
            set to 0.
    """

    device: Size | None = None
    host: Size | None = None
    disk: Size | None = None

    def __post_init__(self) -> None:
        _sizes(self, "engine.budget", TIER_NAMES)
        if self.device is not None and self.device.num_bytes == 0:
            raise ConfigError("engine.budget.device must be more than 0 (the device tier serves "
                              "every request): set [engine.budget] device = \"1GiB\" or a share "
                              "such as \"5%\", or leave it out for the default")
        if all(s is not None and s.num_bytes == 0 for s in (self.host, self.disk)):
            raise ConfigError("engine.budget.host and engine.budget.disk are both 0: device "
                              "blocks do not survive a restart, so keep a host or a disk budget")

    def upper_bound(self, tier: str) -> int | None:
        """The most bytes ``tier`` can resolve to whatever the machine, if the file says it
        (a size, or a default's cap); None for a percentage."""
        size = getattr(self, tier)
        if size is None:
            return {"device": DEFAULT_GPU_DEVICE[1], "host": DEFAULT_HOST[1],
                    "disk": DEFAULT_DISK[1]}[tier]
        return size.num_bytes

    def upper_percent(self, tier: str) -> float | None:
        """The largest share of its total ``tier`` can resolve to, if the file says it (a
        percentage, or a default's share: at most 10%); None for a size."""
        size = getattr(self, tier)
        if size is None:
            return max(DEFAULT_HOST[0], DEFAULT_DISK[0], DEFAULT_GPU_DEVICE[0])
        return size.percent


@dataclasses.dataclass(frozen=True)
class Quota:
    """A tenant's ``max`` or ``reserved``: a ``Size`` per tier, None where it says nothing
    (no cap for ``max``, nothing reserved for ``reserved``). A mapping given to
    ``TenantQuota`` is turned into one (``Quota.of``)."""

    device: Size | None = None
    host: Size | None = None
    disk: Size | None = None

    def __post_init__(self) -> None:
        _sizes(self, "quota", TIER_NAMES)

    @classmethod
    def of(cls, where: str, value) -> "Quota":
        """The quota a mapping says (``{"host": "8GiB"}``); ``where`` names it in errors
        (``tenant 'acme' max``).

        Raises:
            ConfigError: not a mapping, an unknown tier, or a value that is not a size.
        """
        if isinstance(value, Quota):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table of tiers, such as "
                              f"{{ host = \"8GiB\", disk = \"50%\" }}, got {value!r}")
        unknown = sorted(set(value) - set(TIER_NAMES))
        if unknown:
            raise ConfigError(f"{where}: unknown tier {', '.join(repr(k) for k in unknown)}; "
                              f"the tiers are device, host, disk")
        return cls(**{tier: Size.parse(f"{where}.{tier}", v) for tier, v in value.items()})

    def as_table(self) -> dict[str, int | str]:
        """The tiers it names, as written (the TOML inline table)."""
        return {t: getattr(self, t).text for t in TIER_NAMES if getattr(self, t) is not None}


@dataclasses.dataclass(frozen=True)
class TenantQuota:
    """One tenant's ``max`` and ``reserved``, as written; a mapping given as either is read as
    a ``Quota`` (``TenantQuota("acme", max={"host": "8GiB"})``). ``check_quotas`` and
    ``Budget.resolve`` take these (or anything with ``name``, ``max`` and ``reserved``).

    Raises:
        ConfigError: ``max`` or ``reserved`` is not a table of tiers and sizes.
    """

    name: str
    max: Quota = Quota()
    reserved: Quota = Quota()

    def __post_init__(self) -> None:
        for key in ("max", "reserved"):
            object.__setattr__(self, key, Quota.of(f"tenant {self.name!r} {key}",
                                                   getattr(self, key)))


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the budgets are shares of: MemTotal, the state directory's filesystem size, and
    the GPU's memory (None: no GPU; the device tier is then host memory)."""

    mem_total: int
    disk_total: int
    gpu_total: int | None = None

    @classmethod
    def probe(cls, state_dir: str, gpu_total: int | None = None) -> "Machine":
        """This host's: MemTotal from /proc/meminfo (the physical pages where there is none),
        and statvfs of ``state_dir`` (or of its nearest existing parent: it may not exist yet).
        ``gpu_total`` comes from the caller (config does not import torch)."""
        return cls(mem_total_bytes(), filesystem_bytes(state_dir), gpu_total)

    def total(self, tier: str) -> int:
        """What a percentage of ``tier`` is a share of."""
        if tier == "disk":
            return self.disk_total
        if tier == "device" and self.gpu_total is not None:
            return self.gpu_total
        return self.mem_total


def mem_total_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemTotal in bytes (the physical pages times the page size where there is no meminfo)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def filesystem_bytes(path: str) -> int:
    """The size of the filesystem holding ``path`` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


@dataclasses.dataclass(frozen=True)
class TenantBytes:
    """One tenant's quota in bytes: ``max`` per tier (None: no cap beyond the budget) and
    ``reserved`` per tier (0: none), both indexed like ``TIER_NAMES``."""

    name: str
    max: tuple[int | None, int | None, int | None] = (None, None, None)
    reserved: tuple[int, int, int] = (0, 0, 0)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The budgets in bytes, resolved: ``device``, ``host``, ``disk``, the ``spec`` they came
    from, and each tenant's quota in bytes (``tenants``).

    Raises (on construction):
        ConfigError: a negative or non-integer byte count, a device budget of 0, no host and no
            disk budget, a tenant's reserved above its max, or reservations above a budget.
    """

    device: int
    host: int
    disk: int
    spec: BudgetSpec = BudgetSpec()
    tenants: tuple[TenantBytes, ...] = ()

    def __post_init__(self) -> None:
        for tier in TIER_NAMES:
            value = getattr(self, tier)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"engine.budget.{tier} resolved to {value!r}, not a byte "
                                  f"count >= 0")
        if self.device < 1:
            raise ConfigError(f"engine.budget.device resolves to 0 bytes on this host: set "
                              f"[engine.budget] device = \"1GiB\" (now {_written(self.spec, 'device')})")
        if not self.host and not self.disk:
            raise ConfigError("engine.budget.host and engine.budget.disk both resolve to 0 bytes "
                              "on this host: set one of them under [engine.budget]")
        object.__setattr__(self, "tenants", tuple(self.tenants))
        for i, tier in enumerate(TIER_NAMES):
            for t in self.tenants:
                cap = t.max[i]
                if cap is not None and t.reserved[i] > cap:
                    raise ConfigError(_reserved_above_max(t.name, tier, format_bytes(t.reserved[i]),
                                                          format_bytes(cap)))
            reserved = {t.name: t.reserved[i] for t in self.tenants if t.reserved[i]}
            budget = getattr(self, tier)
            if sum(reserved.values()) > budget:
                raise ConfigError(_reservations_above_budget(
                    tier, {n: format_bytes(b) for n, b in reserved.items()},
                    format_bytes(sum(reserved.values())), _written(self.spec, tier),
                    format_bytes(budget)))

    def bytes_of(self, tier: int | str) -> int:
        """The budget of ``tier`` (a name or a ``Tier``)."""
        return getattr(self, tier if isinstance(tier, str) else TIER_NAMES[int(tier)])

    @classmethod
    def resolve(cls, spec: BudgetSpec, machine: Machine, tenants: Iterable = ()) -> "Budget":
        """The budgets ``spec`` (and each tenant's ``max`` / ``reserved``) give on ``machine``.

        Raises:
            ConfigError: see the class.
        """
        tiers = {tier: _resolve_tier(spec, tier, machine) for tier in TIER_NAMES}
        quotas = []
        for t in tenants:
            cap = tuple(None if getattr(t.max, tier) is None
                        else getattr(t.max, tier).resolve(machine.total(tier)) for tier in TIER_NAMES)
            res = tuple(0 if getattr(t.reserved, tier) is None
                        else getattr(t.reserved, tier).resolve(machine.total(tier)) for tier in TIER_NAMES)
            quotas.append(TenantBytes(t.name, cap, res))
        return cls(tiers["device"], tiers["host"], tiers["disk"], spec, tuple(quotas))


def _resolve_tier(spec: BudgetSpec, tier: str, machine: Machine) -> int:
    size = getattr(spec, tier)
    total = machine.total(tier)
    if size is not None:
        return size.resolve(total)
    if tier == "disk":
        share, cap = DEFAULT_DISK
    elif tier == "device" and machine.gpu_total is not None:
        share, cap = DEFAULT_GPU_DEVICE
    else:
        share, cap = DEFAULT_HOST
    return min(int(total * share // 100), cap)


def _written(spec: BudgetSpec, tier: str) -> str:
    size = getattr(spec, tier)
    return "the default" if size is None else f"{size.text!r}"


def _reserved_above_max(tenant: str, tier: str, reserved: str, cap: str) -> str:
    return (f"tenant {tenant!r}: reserved.{tier} ({reserved}) is above its max.{tier} ({cap}): "
            f"lower reserved = {{ {tier} = ... }} or raise max = {{ {tier} = ... }} in its "
            f"[[engine.tenants]]")


def _reservations_above_budget(tier: str, reserved: dict[str, str], total: str, written: str,
                               budget: str) -> str:
    listed = ", ".join(f"{name!r} {b}" for name, b in reserved.items())
    return (f"the tenants' reserved.{tier} add up to {total} ({listed}), more than "
            f"engine.budget.{tier} ({written}: {budget}): lower their reserved.{tier} in "
            f"[[engine.tenants]] or raise [engine.budget] {tier}")


def check_quotas(spec: BudgetSpec, tenants: Iterable) -> None:
    """What the file alone decides of ``Budget``'s checks (see the module docstring), for the
    config reader to run when it reads the file, before any machine is known.

    Raises:
        ConfigError: a tenant's reserved above its max, or reservations above a budget, where
            the sizes compare without the machine.
    """
    tenants = tuple(tenants)
    for tier in TIER_NAMES:
        for t in tenants:
            res, cap = getattr(t.reserved, tier), getattr(t.max, tier)
            if res is None or cap is None or res.is_percent != cap.is_percent:
                continue
            if (res.percent or res.num_bytes) > (cap.percent or cap.num_bytes):
                raise ConfigError(_reserved_above_max(t.name, tier, repr(res.text), repr(cap.text)))
        sizes = {t.name: getattr(t.reserved, tier) for t in tenants
                 if getattr(t.reserved, tier) is not None}
        if not sizes:
            continue
        budget = getattr(spec, tier)
        if all(s.is_percent for s in sizes.values()) and spec.upper_percent(tier) is not None:
            total, bound = sum(s.percent for s in sizes.values()), spec.upper_percent(tier)
            shown = f"{total:g}%"
            bound_text = ("at most " if budget is None else "") + f"{bound:g}%"
        elif not any(s.is_percent for s in sizes.values()) and spec.upper_bound(tier) is not None:
            total, bound = sum(s.num_bytes for s in sizes.values()), spec.upper_bound(tier)
            shown = format_bytes(total)
            bound_text = ("at most " if budget is None else "") + format_bytes(bound)
        else:
            continue
        if total > bound:
            raise ConfigError(_reservations_above_budget(
                tier, {n: repr(s.text) for n, s in sizes.items()}, shown,
                _written(spec, tier), bound_text))
