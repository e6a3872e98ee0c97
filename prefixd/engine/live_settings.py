"""Which engine settings a running engine can take without a restart, and taking them.

A reload (the daemon's config watch or SIGHUP) hands the engine a new ``EngineConfig``; only
the settings in ``LIVE_FIELDS`` may differ from the running one:

- ``eviction``: every pool's eviction queues are re-keyed by the new policy (O(evictable
  nodes), on the caller's thread);
- ``write_policy``: runs indexed or evicted from then on follow it; blocks already placed stay;
- ``checkpoint_records``, ``checkpoint_blocks``: the next ``_log`` compares against them.

Everything else (pool sizes, sync, verify, shm_dir, tenants, ...) is fixed when a pool opens:
the files, the WAL environment and the recovered index were made with it, so a change needs a
restart (``restart_fields`` names them for the log line).
"""

from __future__ import annotations

import dataclasses
import logging

from prefixd.cache.policy import make_policy
from prefixd.engine.config import EngineConfig
from prefixd.engine.records import CHECKPOINT_BLOCKS

log = logging.getLogger(__name__)

LIVE_FIELDS = ("eviction", "write_policy", "checkpoint_records", "checkpoint_blocks")


def changed_fields(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The names of the settings whose values differ, in declaration order."""
    return [f.name for f in dataclasses.fields(EngineConfig)
            if getattr(old, f.name) != getattr(new, f.name)]


def restart_fields(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The changed settings a running engine cannot take."""
    return [name for name in changed_fields(old, new) if name not in LIVE_FIELDS]


def live_config(old: EngineConfig, new: EngineConfig) -> EngineConfig:
    """``old`` with the live settings of ``new``: what the engine runs on after a reload that
    also changed settings needing a restart (those keep their old values)."""
    return dataclasses.replace(old, **{name: getattr(new, name) for name in LIVE_FIELDS})


def apply_live(engine, new: EngineConfig) -> list[str]:
    """Apply ``new``'s live settings to every open pool of ``engine`` and make it the config
    new pools open with; returns the names of the settings that changed.

    Raises:
        ValueError: ``new`` differs from the running config in a setting that needs a restart
            (nothing applied; the caller passes ``live_config(old, new)``).
    """
    old = engine.config
    refused = restart_fields(old, new)
    if refused:
        raise ValueError(f"settings {refused} need a restart; apply live_config(old, new)")
    changed = changed_fields(old, new)
    if not changed:
        return []
    policy = make_policy(new.eviction) if "eviction" in changed else None
    for _, dc in engine.pool_items():
        if policy is not None:
            for queue in dc.cache.tree.queues:
                queue.set_policy(policy)
        if "write_policy" in changed and dc.cache.tiering is not None:
            dc.cache.tiering.set_write_policy(new.write_policy)
        dc.checkpoint_records = new.checkpoint_records
        dc.checkpoint_blocks = (new.checkpoint_blocks if new.checkpoint_blocks is not None
                                else CHECKPOINT_BLOCKS)
    engine.config = new
    log.info("engine settings applied changed=%s pools=%d", ",".join(changed),
             len(engine.pool_items()))
    return changed
