"""The durable engine the daemon calls: the cache core, its storage tiers and its write-ahead log
together (DESIGN.md "The parts").

Modules, one concept each: ``engine`` (``Engine``: every pool, tenant x layout, of one state
directory behind one lock), ``config`` (``EngineConfig``: every setting, validated, from TOML),
``durable`` (``DurableCache``: one pool's operations and the write order), ``recovery``
(opening a state directory), ``replay`` (the log tail onto the tree), ``reconcile`` (what a
restart drops), ``snapshot`` (the tree as checkpoint values), ``records`` (cache events as WAL
records), ``errors``.
"""

from prefixd.engine.config import EngineConfig, Tenant, TierSizes
from prefixd.engine.durable import DurableCache, Reclaimed
from prefixd.engine.engine import Engine, PoolInfo
from prefixd.engine.errors import (ConfigError, DurabilityError, EngineError, IndexLostError,
                                   PoolDirError, StateFormatError, UnknownTenantError)

__all__ = ["ConfigError", "DurabilityError", "DurableCache", "Engine", "EngineConfig",
           "EngineError", "IndexLostError", "PoolDirError", "PoolInfo", "Reclaimed",
           "StateFormatError", "Tenant", "TierSizes", "UnknownTenantError"]
