"""``EngineConfig``: every setting of the durable engine, validated once.

The daemon's config file holds an ``[engine]`` table (and tables of its own, which the engine
ignores)::

    [engine]
    sync = "commit"            # "commit" | "interval" | "none"
    sync_interval_ms = 1000    # the fsync period of "interval"
    write_policy = "write_through"
    eviction = "lru"
    verify = "lazy"            # "lazy" | "eager"
    checkpoint_records = 100000
    # checkpoint_blocks = 500000    # absent: the engine's default (500,000)
    spill_blocks = 256
    reclaim_grace_s = 30.0
    shm_dir = "/dev/shm"
    use_cuda = false           # true | false | "auto"
    forget_missing_tier = false

    [engine.budget]            # bytes per tier for the whole daemon (prefixd.config.budget_settings)
    device = "4GiB"            # a size, or a share: "5%"
    host = "10%"
    disk = "32GiB"

    [engine.blocks]            # optional: the most blocks one pool (tenant x layout) takes
    device = 1024              #   per tier (absent: no cap but the budget)
    host = 4096
    disk = 16384

    [engine.blocks.models."tiny-llama"]   # per model_id; missing tiers keep the defaults
    device = 256

    [[engine.tenants]]
    name = "default"
    salt = ""             # the same on every host of a fleet: it names the cluster tier's keys
    max = { host = "8GiB" }          # optional: the most this tenant's blocks take per tier
    reserved = { host = "1GiB" }     # optional: bytes other tenants' blocks never take from it

    [engine.cluster]           # optional: see prefixd.config.cluster_settings
    nodes = ["127.0.0.1:7000"]

Every value is checked in ``__post_init__`` (so a config built in code is checked too), and a
bad one raises ``ConfigError`` saying which key to change and to what. Unknown keys are errors
that name the known ones (``prefixd.config.toml_reader``, which reads the table;
``prefixd.config.toml_writer`` writes it): a misspelt key silently left at its default is worse
than a refusal.
"""

from __future__ import annotations

import dataclasses
import math
import re

from prefixd.api.layout import KVLayout
from prefixd.config.budget_settings import BudgetSpec, Quota, check_quotas
from prefixd.config.cluster_settings import ClusterConfig
from prefixd.config.errors import ConfigError

SYNC_MODES = ("commit", "interval", "none")
VERIFY_MODES = ("lazy", "eager")
# NOTE: the names of what ``prefixd.cache.tiering`` and ``prefixd.cache.policy`` implement,
# written here because config imports only api/; tests/config/test_engine_settings.py checks that
# cache implements exactly these.
WRITE_POLICIES = ("write_through", "write_back", "selective")
EVICTION_POLICIES = ("lru", "lfu", "priority")
# NOTE: a tenant name is a directory name under the state directory and a socket file stem:
# no separators, no leading dot, nothing a shell or a path join could misread.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _choice(key: str, value, choices) -> None:
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"engine.{key} must be one of {listed}, got {value!r}: "
                          f"set [engine] {key} = \"{choices[0]}\" (or another of them)")


@dataclasses.dataclass(frozen=True)
class TierSizes:
    """Pool sizes in blocks of one pool: ``device`` >= 1, and a ``host`` or a ``disk`` tier
    (device blocks do not survive a restart, so a durable pool needs one of them)."""

    device: int = 1024
    host: int = 4096
    disk: int = 16384

    def __post_init__(self) -> None:
        for tier in ("device", "host", "disk"):
            value = getattr(self, tier)
            if not _is_int(value) or value < 0:
                raise ConfigError(f"engine.blocks.{tier} must be a block count >= 0, got "
                                  f"{value!r}: set [engine.blocks] {tier} = <blocks>")
        if self.device < 1:
            raise ConfigError("engine.blocks.device must be >= 1 (the device tier serves every "
                              f"request), got {self.device}: set [engine.blocks] device = <blocks>")
        if not self.host and not self.disk:
            raise ConfigError("engine.blocks needs a host or a disk tier (device blocks do not "
                              "survive a restart): set [engine.blocks] host or disk > 0")

    def as_tuple(self) -> tuple[int, int, int]:
        """``(device, host, disk)``, the form ``DurableCache`` takes."""
        return (self.device, self.host, self.disk)


@dataclasses.dataclass(frozen=True)
class Tenant:
    """One tenant: a name (safe as a directory name), the salt that enters its root hash, and
    its quota: ``max`` (the most its blocks take per tier) and ``reserved`` (bytes per tier
    other tenants' blocks never take from it), each a ``Quota`` (a mapping is read as one).

    ``salt`` is bytes; a ``str`` given here is taken as UTF-8 (what a TOML file holds).
    """

    name: str
    salt: bytes = b""
    max: Quota = Quota()
    reserved: Quota = Quota()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TENANT_NAME.fullmatch(self.name):
            raise ConfigError(
                f"tenant name {self.name!r} is not allowed: use 1..64 letters, digits, '_', '-' "
                f"or '.', starting with a letter or digit (it names a directory)")
        if isinstance(self.salt, str):
            object.__setattr__(self, "salt", self.salt.encode())
        if not isinstance(self.salt, bytes):
            raise ConfigError(f"tenant {self.name!r}: salt must be a string or bytes, "
                              f"got {type(self.salt).__name__}")
        for key in ("max", "reserved"):
            object.__setattr__(self, key, Quota.of(f"tenant {self.name!r} {key}",
                                                   getattr(self, key)))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine setting and its default.

    Attributes:
        budget: the bytes per tier the whole daemon may take (``[engine.budget]``); every pool
            draws from it (``prefixd.engine.budgets``).
        blocks: the most blocks of one pool per tier, a cap under the budget (None: no cap;
            a table that names some tiers gives the others ``TierSizes``' defaults).
        model_blocks: ``(model_id, TierSizes)`` pairs that replace ``blocks`` for a layout.
        sync, sync_interval_ms: the WAL's fsync policy (``prefixd.wal.Wal``).
        write_policy: ``write_through`` / ``write_back`` / ``selective`` (``prefixd.cache.tiering``).
        eviction: the eviction order (``prefixd.cache.policy``).
        verify: ``lazy`` (disk checksums checked on promotion) or ``eager`` (also at recovery).
        checkpoint_records: fold the log into a checkpoint after this many records.
        checkpoint_blocks: fold once the log tail names this many blocks (None: the engine's
            default, or no such trigger where the engine has none).
        spill_blocks: batch size of write-through to disk.
        reclaim_grace_s: how long recovered sequences wait for their client.
        shm_dir: where host (and CPU device) pool files live.
        use_cuda: device tier on the GPU: True, False, or None (when CUDA is available).
        forget_missing_tier: a pool file gone from disk drops its blocks from the index at
            recovery (counted) instead of refusing to start.
        tenants: the tenants served; names and salts are unique.
        cluster: the Redis Cluster tier below disk (``[engine.cluster]``,
            ``prefixd.config.cluster_settings``), or None: no cluster tier.

    NOTE: frozen and validated once: the daemon builds one at start (and one per reload) and
    hands each constructor only the values it needs, so no component reads a half-valid config.
    """

    budget: BudgetSpec = BudgetSpec()
    blocks: TierSizes | None = None
    model_blocks: tuple[tuple[str, TierSizes], ...] = ()
    sync: str = "commit"
    sync_interval_ms: float = 1000.0
    write_policy: str = "write_through"
    eviction: str = "lru"
    verify: str = "lazy"
    checkpoint_records: int = 100_000
    checkpoint_blocks: int | None = None
    spill_blocks: int = 256
    reclaim_grace_s: float = 30.0
    shm_dir: str = "/dev/shm"
    use_cuda: bool | None = False
    forget_missing_tier: bool = False
    tenants: tuple[Tenant, ...] = (Tenant("default"),)
    cluster: ClusterConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, BudgetSpec):
            raise ConfigError(f"engine.budget must be a BudgetSpec, got "
                              f"{type(self.budget).__name__}")
        if self.blocks is not None and not isinstance(self.blocks, TierSizes):
            raise ConfigError(f"engine.blocks must be TierSizes, got {type(self.blocks).__name__}")
        object.__setattr__(self, "model_blocks", tuple(tuple(p) for p in self.model_blocks))
        seen_models = set()
        for pair in self.model_blocks:
            if (len(pair) != 2 or not isinstance(pair[0], str) or not pair[0]
                    or not isinstance(pair[1], TierSizes)):
                raise ConfigError(f"engine.model_blocks entries must be (model_id, TierSizes), "
                                  f"got {pair!r}")
            if pair[0] in seen_models:
                raise ConfigError(f"engine.blocks.models names {pair[0]!r} twice: keep one")
            seen_models.add(pair[0])
        _choice("sync", self.sync, SYNC_MODES)
        if not _is_number(self.sync_interval_ms) or self.sync_interval_ms <= 0:
            raise ConfigError(f"engine.sync_interval_ms must be a number of milliseconds > 0, "
                              f"got {self.sync_interval_ms!r}: set [engine] sync_interval_ms = 1000")
        _choice("write_policy", self.write_policy, WRITE_POLICIES)
        _choice("eviction", self.eviction, EVICTION_POLICIES)
        _choice("verify", self.verify, VERIFY_MODES)
        for key in ("checkpoint_records", "spill_blocks"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"engine.{key} must be an integer >= 1, got {value!r}: "
                                  f"set [engine] {key} = <count>")
        if self.checkpoint_blocks is not None and (
                not _is_int(self.checkpoint_blocks) or self.checkpoint_blocks < 1):
            raise ConfigError(f"engine.checkpoint_blocks must be an integer >= 1, got "
                              f"{self.checkpoint_blocks!r}: set [engine] checkpoint_blocks = "
                              f"<blocks>, or leave it out for the engine's default")
        if not _is_number(self.reclaim_grace_s) or self.reclaim_grace_s < 0:
            raise ConfigError(f"engine.reclaim_grace_s must be a number of seconds >= 0, got "
                              f"{self.reclaim_grace_s!r}: set [engine] reclaim_grace_s = 30")
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise ConfigError(f"engine.shm_dir must be a directory path, got {self.shm_dir!r}: "
                              f"set [engine] shm_dir = \"/dev/shm\"")
        if self.use_cuda not in (True, False, None):
            raise ConfigError(f"engine.use_cuda must be true, false or \"auto\", got "
                              f"{self.use_cuda!r}: set [engine] use_cuda = false")
        if not isinstance(self.forget_missing_tier, bool):
            raise ConfigError(f"engine.forget_missing_tier must be true or false, got "
                              f"{self.forget_missing_tier!r}")
        if self.cluster is not None and not isinstance(self.cluster, ClusterConfig):
            raise ConfigError(f"engine.cluster must be a ClusterConfig, got "
                              f"{type(self.cluster).__name__}")
        self._check_tenants()

    def _check_tenants(self) -> None:
        tenants = tuple(self.tenants)
        object.__setattr__(self, "tenants", tenants)
        if not tenants:
            raise ConfigError("engine.tenants is empty: add at least one [[engine.tenants]] "
                              "with a name and a salt")
        names: dict[str, str] = {}
        salts: dict[bytes, str] = {}
        for tenant in tenants:
            if not isinstance(tenant, Tenant):
                raise ConfigError(f"engine.tenants entries must be Tenant, got {tenant!r}")
            if tenant.name in names:
                raise ConfigError(f"engine.tenants names {tenant.name!r} twice: give each "
                                  f"tenant its own name")
            names[tenant.name] = tenant.name
            # NOTE: the salt namespaces a tenant's blocks beyond this host too (cluster-tier
            # keys): two tenants with one salt would share keys there.
            if tenant.salt in salts:
                raise ConfigError(f"tenants {salts[tenant.salt]!r} and {tenant.name!r} have the "
                                  f"same salt: give each tenant its own salt")
            salts[tenant.salt] = tenant.name
        check_quotas(self.budget, tenants)

    # -- lookups --------------------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant | None:
        """The configured tenant called ``name``, or None."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        return None

    def blocks_for(self, layout: KVLayout) -> TierSizes | None:
        """The cap on a pool of ``layout`` (its model's override, else ``blocks``; None: no
        cap but the budget)."""
        for model_id, sizes in self.model_blocks:
            if model_id == layout.model_id:
                return sizes
        return self.blocks
