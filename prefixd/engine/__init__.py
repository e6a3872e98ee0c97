"""The durable engine the daemon calls: the cache core, its storage tiers and its write-ahead log
together (DESIGN.md "The parts").

Modules, one concept each: ``engine`` (``Engine``: every pool, tenant x layout, of one state
directory behind one lock), ``durable`` (``DurableCache``: one pool's operations and the write
order), ``upkeep`` (the pool's log step and the work that follows it: quarantine release,
headroom, spill, checkpoint),
``recovery`` (what a pool is rebuilt from: ``recover`` returns ``Recovered``), ``replay`` (the
log tail onto the tree), ``reconcile`` (what a restart drops), ``checkpoint`` (the tree as
checkpoint values, and when one is due), ``kv_io`` (a pool's KV by token: the rules and the
copies), ``records`` (cache events as WAL records), ``errors``.

Its settings are ``prefixd.config``'s (``EngineConfig``, re-exported here with ``Tenant``,
``TierSizes`` and ``ConfigError`` because an engine is built with them).
"""

from prefixd.config.engine_settings import EngineConfig, Tenant, TierSizes
from prefixd.config.errors import ConfigError
from prefixd.engine.durable import DurableCache, Reclaimed
from prefixd.engine.engine import Engine, PoolInfo
from prefixd.engine.errors import (DurabilityError, EngineError, IndexLostError,
                                   PoolDirError, StateFormatError, UnknownTenantError)

__all__ = ["ConfigError", "DurabilityError", "DurableCache", "Engine", "EngineConfig",
           "EngineError", "IndexLostError", "PoolDirError", "PoolInfo", "Reclaimed",
           "StateFormatError", "Tenant", "TierSizes", "UnknownTenantError"]
