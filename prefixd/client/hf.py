"""prefixd for transformers: ``generate`` whose prompt K/V come from (and go to) a prefixd daemon.

The API (stable; everything else in ``hf_cache`` / ``hf_attention`` is internal)::

    import prefixd.client as pc
    from prefixd.client.hf import PrefixdCache, generate_with_prefix, layout_for

    layout = layout_for(model, "smollm2-135m")            # KVLayout from model.config, block_size 16
    with pc.connect(socket, layout, mapped=True) as session:
        out = generate_with_prefix(model, session, input_ids, attention_mask=mask,
                                   max_new_tokens=32, do_sample=False)
        # or, to read what it did:
        with PrefixdCache(session, model, input_ids, mask) as cache:
            out = model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                                 max_new_tokens=32, do_sample=False)
        cache.reused_tokens, cache.forward_tokens, cache.cached_tokens

- ``PrefixdCache(session, model, input_ids, attention_mask=None, *, durability="crash",
  backend="auto")`` opens one sequence per prompt at once (so make it right before
  ``generate``, with the same ``input_ids`` and ``attention_mask``: left padding only), and
  switches ``model`` to the ``prefixd_paged`` attention until ``close()`` (or the end of the
  ``with`` block, which commits only if no exception escaped). Use it for ONE ``generate`` call,
  and one at a time per model object (the attention switch is the model's: a second model
  object, sharing the weights, serves a concurrent request).
  ``generate`` then runs the model only on the columns past what every prompt has cached; the
  prompts' full blocks are committed before the first decode step (durability as given), the
  generated tokens' full blocks at close. ``num_return_sequences=n`` forks each prompt's sequence
  into ``n``. Not supported: beam search, assisted decoding, ``inputs_embeds``, right padding,
  a session without the mapped pool (``mapped=False``), a model on another device than the pool.
  Counters: ``prompt_tokens``, ``reused_tokens`` (prompt tokens not recomputed),
  ``cached_tokens`` (per prompt, as the daemon answered), ``forward_tokens`` (token positions the
  model ran on, all rows and forwards).
- ``generate_with_prefix(model, session, input_ids, attention_mask=None, *, durability="crash",
  retries=1, **generate_kwargs)``: the ``with`` block above, run again if it met a daemon
  restart; returns ``generate``'s output.
- ``layout_for(model, model_id, block_size=16)``: the ``KVLayout`` to connect with (layers, KV
  heads, head dim and dtype from the model; the pool must match the model exactly).

A daemon restart between requests: the session reconnects and committed prefixes stay hits; the
first request after it may still raise ``DaemonRestarted`` from ``generate`` (the recovery can
run under it and cut its sequences back), which ``generate_with_prefix`` answers by running the
request again; with ``PrefixdCache`` directly, catch it and rerun the request.

Needs transformers (``pip install prefixd[hf]``); ``import prefixd.client`` does not import this.
"""

from __future__ import annotations

import logging

from prefixd.api.layout import KVLayout
from prefixd.client.errors import DaemonRestarted
from prefixd.client.hf_attention import ATTENTION_NAME, PagedKVContext, register_hf_attention
from prefixd.client.hf_cache import PrefixdCache, layout_fields

log = logging.getLogger(__name__)

__all__ = ["ATTENTION_NAME", "PagedKVContext", "PrefixdCache", "generate_with_prefix", "layout_for",
           "register_hf_attention"]


def layout_for(model, model_id: str, block_size: int = 16) -> KVLayout:
    """The pool layout of ``model``'s KV (a transformers decoder), keyed by ``model_id``."""
    return KVLayout(model_id=model_id, block_size=block_size, **layout_fields(model))


def generate_with_prefix(model, session, input_ids, attention_mask=None, *, durability: str = "crash",
                         retries: int = 1, **generate_kwargs):
    """``model.generate`` over a ``PrefixdCache`` of ``session``, closed (and committed) after.

    A request that meets a daemon restart (``DaemonRestarted``: the session recovered, but this
    request's sequences were cut back or lost) is run again from the start, up to ``retries``
    times; committed prefixes are hits again. With sampling, a rerun draws from where the random
    generator stands, so seed per request if outputs must repeat.

    Raises:
        InvalidArgument: a layout that does not match the model, right padding;
        MappingError: a session without the mapped pool; DaemonRestarted: more restarts than
        ``retries``; whatever ``generate`` raises (the sequences are then released without
        commit).
    """
    for attempt in range(retries + 1):
        try:
            with PrefixdCache(session, model, input_ids, attention_mask, durability=durability) as cache:
                return model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                                      **generate_kwargs)
        except DaemonRestarted as exc:
            if attempt == retries:
                raise
            log.warning("daemon restarted during a request (%s); running it again", exc)
    raise AssertionError("unreachable")
