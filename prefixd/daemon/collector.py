"""The daemon's cyclic garbage collector policy: what was alive when serving began is frozen.

Once the engine has recovered, the process holds a few hundred thousand objects that live as
long as it does: torch's, gRPC's and every imported module's (~180k, the import of torch most of
them), and the recovered index. CPython's full collection walks every tracked object each
time the objects promoted since the last one pass a quarter of those already old: a walk of
~200k objects, hundreds of milliseconds on the loop's thread, in the middle of serving.
``freeze_startup_heap`` collects once (the start-up's own garbage is freed, not frozen) and
moves every survivor to the permanent generation (``gc.freeze``): later collections walk only
what serving made, which a full collection still covers.

NOTE: an object frozen here is never collected as cyclic garbage: a reference cycle among
start-up objects that later dies stays in memory until the process exits (plain reference
counting still frees everything else). The radix tree unlinks a node from its parent's
children when it drops it, so an evicted recovered node is freed by its count.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze every tracked object; returns how many are frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("collector froze start-up objects count=%d seconds=%.3f", frozen, time.perf_counter() - t0)
    return frozen


def frozen() -> int:
    """Objects in the permanent generation (what ``freeze_startup_heap`` moved there)."""
    return gc.get_freeze_count()


def collections() -> list[int]:
    """Collections so far, by generation (0, 1, 2)."""
    return [g["collections"] for g in gc.get_stats()]
