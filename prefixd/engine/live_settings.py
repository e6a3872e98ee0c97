"""Applying the live engine settings (``prefixd.config.live_keys.ENGINE_LIVE_KEYS``) to a
running engine, without a restart.

- ``eviction``: every pool's eviction queues are re-keyed by the new policy (O(evictable
  nodes), on the caller's thread);
- ``write_policy``: runs indexed or evicted from then on follow it; blocks already placed stay;
- ``checkpoint_records``, ``checkpoint_blocks``: the next ``_log`` compares against them.
"""

from __future__ import annotations

import logging

from prefixd.cache.policy import make_policy
from prefixd.config.engine_settings import EngineConfig
from prefixd.config.live_keys import changed_fields, restart_fields
from prefixd.engine.records import CHECKPOINT_BLOCKS

log = logging.getLogger(__name__)


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
