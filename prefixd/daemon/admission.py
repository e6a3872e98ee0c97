"""Whether a client's layout gets a useful pool, checked at Attach, before any file is made.

Every pool draws from the daemon's byte budgets (``prefixd.engine.budgets``): a pool's blocks
per tier are its tier's budget in whole blocks, capped by ``[engine.blocks]`` (per model
``[engine.blocks.models."<id>"]``), and every request a client opens takes device blocks for
its whole prompt. So an Attach is refused with RESOURCE_EXHAUSTED, naming the budget or the
cap, what it holds, and the key to raise, when:

- its layout's block is larger than ``[daemon.limits] max_block_bytes``;
- the device tier cannot hold one request of the client's ``max_model_len``
  (``AttachRequest.max_model_len``), or a single block when the client does not say it;
- one such request (its extents and its files' headers) is more than its tenant may ever
  hold in a tier: its ``max``, and the tier's budget less every other tenant's ``reserved``.
  What other pools hold now is not a reason: a new pool's first extents are made room for by
  the cross-pool LRU (``Engine.make_room_for``) before its files are made.

A client that does not send ``max_model_len`` (0) is let in above one block, and the daemon
logs ONE WARNING per pool whose device tier is below ``FLOOR_TOKENS``.

NOTE: the floor is 1,024 tokens: a chat prompt with a system prompt and a few turns is longer,
so a pool below it serves next to nothing; pools of the test suite (256 blocks of 4 tokens)
sit at it and stay quiet. The alternative, refusing below the floor without a
``max_model_len``, would refuse clients whose prompts are short by design.
"""

from __future__ import annotations

import logging

from prefixd.api.layout import KVLayout
from prefixd.daemon.status import exhausted

log = logging.getLogger(__name__)

FLOOR_TOKENS = 1024

_warned: set[tuple[str, KVLayout]] = set()  # pools already warned about (once per daemon)


def check_attach(budgets, tenant: str, layout: KVLayout, max_model_len: int, *,
                 max_block_bytes: int | None = None) -> None:
    """Refuse (RESOURCE_EXHAUSTED) an Attach whose pool cannot be useful or cannot fit (see the
    module docstring); warn once per pool below the floor when the client's length is unknown.

    Args:
        budgets: the engine's ``Budgets`` (pool sizes, ledgers, the keys to name).
        max_model_len: the client's longest request in tokens; 0 when unknown.
        max_block_bytes: ``[daemon.limits] max_block_bytes`` (None: no limit).
    Raises:
        RpcFailure: RESOURCE_EXHAUSTED, with what to raise.
    """
    if max_block_bytes is not None and layout.block_bytes > max_block_bytes:
        raise exhausted(f"layout {layout.model_id!r} has blocks of {layout.block_bytes} bytes, more "
                        f"than [daemon.limits] max_block_bytes = {max_block_bytes}: raise it, or "
                        f"use a smaller block_size")
    why = budgets.refusal(tenant, layout, max_model_len)
    if why is not None:
        raise exhausted(why)
    device = budgets.pool_sizes(layout)[0]
    bs = layout.block_size
    if not max_model_len and device * bs < FLOOR_TOKENS and (tenant, layout) not in _warned:
        _warned.add((tenant, layout))
        log.warning("pool too small to be useful tenant=%s model_id=%s device_blocks=%d tokens=%d floor_tokens=%d: "
                    "raise %s device or [engine.budget] device (the client did not say its max_model_len)",
                    tenant, layout.model_id, device, device * bs, FLOOR_TOKENS, budgets.cap_key(layout))
