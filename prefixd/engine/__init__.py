"""The durable engine the daemon calls: the cache core, its storage tiers and its write-ahead log
together (DESIGN.md "The parts").

Modules, one concept each: ``durable`` (``DurableCache``: one pool's operations and the write
order), ``recovery`` (opening a state directory), ``replay`` (the log tail onto the tree),
``reconcile`` (what a restart drops), ``snapshot`` (the tree as checkpoint values), ``records``
(cache events as WAL records), ``errors``.
"""

from prefixd.engine.durable import DurableCache, Reclaimed
from prefixd.engine.errors import DurabilityError, EngineError, IndexLostError, StateFormatError

__all__ = ["DurabilityError", "DurableCache", "EngineError", "IndexLostError", "Reclaimed",
           "StateFormatError"]
