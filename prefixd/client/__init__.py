"""prefixd.client: attach to a prefixd daemon and share its KV cache (DESIGN.md "Client library").

```python
import prefixd.client as pc
layout = pc.KVLayout(model_id="tiny-llama", num_layers=4, num_kv_heads=2, head_dim=64,
                     dtype="float16", block_size=16)
with pc.connect(socket_path, layout, name="engine-0") as session:   # Attach ... Detach
    seq = session.open(tokens)          # seq.cached_tokens: compute KV only past it
    session.write_kv(seq, seq.cached_tokens, kv)
    session.commit(seq)
```

Imports only ``prefixd.api``, ``prefixd.config`` and ``prefixd.kernels``
(tests/test_layering.py). Modules: ``session`` (connect, Session, reconnect semantics),
``attachment`` (channel, Attach/Detach, lease, recovery), ``handles`` (Sequence, LookupResult),
``errors`` (typed exceptions), ``keepalive`` (the lease thread), ``mapped`` (pool mappings and
the mapped KV path), ``remote_kv`` (WriteKV / ReadKV / Attend), ``reconnect`` (backoff, reclaim),
``wire`` (token ids on the wire), ``kv_events`` (KV events for routers), ``ctl`` (prefixctl),
``breaker`` (fail fast while the daemon does not answer).

NOTE: ``Session`` and ``connect`` load on first access: ``session`` imports torch (seconds),
and ``prefixctl`` (``prefixd.client.ctl``) imports this package without needing either.
"""

from prefixd.api.layout import KVLayout
from prefixd.client.errors import (DaemonRestarted, DataLoss, DeadlineExceeded, FailedPrecondition,
                                   InvalidArgument, MappingError, NotFound, PrefixdError, ResourceExhausted,
                                   SharedBlockError, Unavailable)
from prefixd.client.kv_events import KVEvent
from prefixd.client.handles import LookupResult, Sequence
from prefixd.client.reconnect import Backoff

__all__ = [
    "Backoff",
    "DaemonRestarted",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KVEvent",
    "KVLayout",
    "LookupResult",
    "MappingError",
    "NotFound",
    "PrefixdError",
    "ResourceExhausted",
    "Sequence",
    "Session",
    "SharedBlockError",
    "Unavailable",
    "connect",
]


def __getattr__(name: str):
    if name in ("Session", "connect"):
        from prefixd.client import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
