"""prefixd as a vLLM KV connector: vLLM's prompts' KV outlives the vLLM process and is shared by
every vLLM on the host.

```python
from vllm import LLM
from vllm.config import KVTransferConfig

llm = LLM(model=MODEL_DIR, kv_transfer_config=KVTransferConfig(
    kv_connector="PrefixdConnector", kv_connector_module_path="prefixd.client.vllm",
    kv_role="kv_both",
    kv_connector_extra_config={"prefixd.socket": "/run/prefixd/prefixd.sock",
                               "prefixd.durability": "crash"}))
```

``kv_connector_extra_config`` keys:

- ``prefixd.socket`` (required): the daemon's Unix socket.
- ``prefixd.durability``: what a commit waits for: ``index``, ``crash`` (default: survives a
  ``kill -9`` of the daemon), ``power``.
- ``prefixd.model_id``: the pool's model id (default: the ``model`` vLLM was given, as given;
  two vLLMs share a pool only with the same id, block size, dtype and shape, so set it when
  the same model is loaded from different paths).
- ``prefixd.request_timeout_ms`` (1000): deadline of every daemon call on vLLM's engine thread.
  A call that misses it (a hung or dead daemon) trips the session's circuit breaker: every
  later call is a miss answered at once until a background probe sees the daemon answer.
- ``prefixd.timeout_s`` (30): deadline of Attach, which runs on a background thread (the
  first Attach of a layout makes the pool). ``prefixd.retry_s`` (2): the most seconds between
  two attempts to attach while no daemon answers.
- ``prefixd.log_level`` (``INFO``): level of the stderr handler the connector gives the
  ``prefixd.client.vllm`` logger when nothing else handles it (``""``: none).

What it does: the scheduler opens the prompt in the daemon (``Open``: one rpc pins the prefix
the daemon holds; vLLM is offered its whole blocks below the last token), and releases it
when the request finishes, committing the prompt's newly computed full blocks at the
configured durability once the worker saved them. The worker copies blocks between vLLM's
paged KV tensors (their layout found from the tensors themselves, ``paged_layout``) and the
daemon's mapped pool, before the forward (loads) and after it (saves). prefixd's block size
is vLLM's ``cache_config.block_size``: the connector attaches with a KV layout built from
vLLM's cache spec, and the daemon keeps a pool per layout. A daemon that is down or
restarting is a miss, never a failed request. Under tensor or pipeline parallelism the layout
is the whole model's (every layer and KV head, whatever the TP/PP sizes, so engines of any
size share blocks), each worker copies only its slice of a block (its KV heads, its stage's
layers: ``shards``), and a prompt is committed only once every worker saved its slice. One
INFO line per request on the ``prefixd.client.vllm`` logger gives its ``external_hit_tokens``.

Modules: ``connector`` (the vLLM class; the only one that imports vLLM), ``scheduler`` and
``worker`` (the two halves), ``metadata`` (what travels between them), ``paged_layout``
(vLLM's KV tensor forms), ``shards`` (which slice of a block a TP/PP rank holds),
``block_transfer`` (the copies), ``daemon_link`` (a session where trouble is a miss),
``miss_log`` (misses said at WARNING once a minute per reason), ``options`` (the keys above).

NOTE: this package imports without vLLM; ``PrefixdConnector`` is loaded on first access
(vLLM's loader does ``getattr(module, "PrefixdConnector")``).
"""

from __future__ import annotations

__all__ = ["PrefixdConnector"]


def __getattr__(name: str):
    if name == "PrefixdConnector":
        from prefixd.client.vllm.connector import PrefixdConnector

        return PrefixdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
