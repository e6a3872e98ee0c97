"""Whether a pool is big enough for a client, checked at Attach.

A pool is sized by the operator (``[engine.blocks]``, per model ``[engine.blocks.models."<id>"]``)
and every request a client opens takes device blocks for its whole prompt. A pool whose device
tier holds fewer blocks than one request of the client's ``max_model_len`` cannot serve such a
request at all: the client would miss on it forever while the daemon says nothing. So:

- a client that sends ``max_model_len`` (``AttachRequest.max_model_len``) is refused at Attach
  with RESOURCE_EXHAUSTED naming the pool's size, what one request needs, and the key to raise;
- a client that does not (0) is let in, and the daemon logs ONE WARNING per pool whose device
  tier is below ``FLOOR_TOKENS``.

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


def check_attach(config, tenant: str, layout: KVLayout, max_model_len: int) -> None:
    """Refuse (RESOURCE_EXHAUSTED) a client whose one longest request cannot fit the pool of
    ``layout``; warn once per pool below the floor when the client's length is unknown.

    Args:
        config: the engine's config (``blocks_for(layout)`` gives the pool's tier sizes).
        max_model_len: the client's longest request in tokens; 0 when unknown.
    Raises:
        RpcFailure: RESOURCE_EXHAUSTED, with what to raise.
    """
    device = config.blocks_for(layout).device
    bs = layout.block_size
    key = _key_to_raise(config, layout)
    if max_model_len:
        need = -(-max_model_len // bs)
        if device < need:
            raise exhausted(f"the pool of layout {layout.model_id!r} holds {device} device blocks "
                            f"({device * bs} tokens of block_size {bs}); one request of the client's "
                            f"max_model_len={max_model_len} needs {need} blocks: raise {key} to at least "
                            f"{need} (or run the client with a smaller max_model_len)")
        return
    if device * bs < FLOOR_TOKENS and (tenant, layout) not in _warned:
        _warned.add((tenant, layout))
        log.warning("pool too small to be useful tenant=%s model_id=%s device_blocks=%d tokens=%d floor_tokens=%d: "
                    "raise %s (the client did not say its max_model_len)", tenant, layout.model_id, device,
                    device * bs, FLOOR_TOKENS, key)


def _key_to_raise(config, layout: KVLayout) -> str:
    """The config key that sizes this layout's device tier."""
    if any(model_id == layout.model_id for model_id, _ in config.model_blocks):
        return f'[engine.blocks.models."{layout.model_id}"] device'
    return "[engine.blocks] device"
