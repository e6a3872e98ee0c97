"""A cold restart, as ``bench/recovery.py`` times it: the page cache dropped (root only), then a
FRESH Python process that stamps the time on its first line, imports ``prefixd`` and
constructs ``DurableCache`` over the state directory (the constructor is recovery), and
prints its clocks and ``recovery`` phases as one JSON line.

``recover`` runs one such restart and returns its timings: ``ready_s`` is the constructor's
own clock (open -> ready), split into ``open_s``, ``checkpoint_load_s``, ``replay_s``,
``reconcile_s`` (+ the RECOVER record); interpreter start-up and imports are reported beside
it, not inside it (``process_to_ready_s``: the parent's clock before spawning -> constructor
returned). ``lazy_recoveries`` runs several with lazy verify and keeps the median.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from recovery_state import LAYOUT

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PHASES = ("open_s", "checkpoint_load_s", "replay_s", "reconcile_s")

CHILD = r"""
import time
t_first = time.time()
import json, sys
sys.path.insert(0, sys.argv[1])
from prefixd.api.layout import KVLayout
from prefixd.engine.durable import DurableCache
t_imported = time.time()
args = json.loads(sys.argv[2])
layout = KVLayout(**args["layout"])
dc = DurableCache(args["state"], layout, tuple(args["sizes"]), shm_dir=args["shm"], verify=args["verify"])
t_ready = time.time()
rec = dict(dc.recovery)
rec["tree_blocks"] = sum(n.num_blocks for n in dc.cache.tree.nodes())
rec["tree_nodes"] = sum(1 for _ in dc.cache.tree.nodes())
dc.close()
print(json.dumps({"t_first": t_first, "t_imported": t_imported, "t_ready": t_ready, "recovery": rec}))
"""


def drop_page_cache() -> bool:
    """Drop the kernel's page cache (root only); returns whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def recover(state: str, shm: str, sizes: list[int], verify: str) -> dict:
    """Open ``state`` in a fresh process; returns its timings."""
    args = {"state": state, "shm": shm, "sizes": sizes, "verify": verify,
            "layout": {"model_id": LAYOUT.model_id, "num_layers": LAYOUT.num_layers,
                       "num_kv_heads": LAYOUT.num_kv_heads, "head_dim": LAYOUT.head_dim,
                       "dtype": LAYOUT.dtype, "block_size": LAYOUT.block_size}}
    dropped = drop_page_cache()
    t_spawn = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, ROOT, json.dumps(args)], check=True,
                         capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    rec = got["recovery"]
    result = {"ready_s": round(rec["ready_s"], 4)}
    for k in PHASES:
        result[k] = round(rec[k], 4)
    result["recover_record_s"] = round(rec["ready_s"] - sum(rec[k] for k in PHASES), 4)
    result["records_replayed"] = rec["records_replayed"]
    result["blocks_replayed"] = rec.get("blocks_replayed")
    if "verified_blocks" in rec:
        result["verified_blocks"] = rec["verified_blocks"]
    result["blocks_by_tier"] = rec["blocks"]
    result["tree_blocks"] = rec["tree_blocks"]
    result["tree_nodes"] = rec["tree_nodes"]
    result["interpreter_start_s"] = round(got["t_first"] - t_spawn, 4)
    result["import_s"] = round(got["t_imported"] - got["t_first"], 4)
    result["process_to_ready_s"] = round(got["t_ready"] - t_spawn, 4)
    result["page_cache_dropped"] = dropped
    return result


def lazy_recoveries(state: str, shm: str, sizes: list[int], repeats: int) -> dict:
    """``repeats`` cold recoveries of ``state`` with lazy verify, one after another (each
    appends one RECOVER record: the tail grows by one per run). Returns ``lazy`` (the median
    run, all its phases), ``lazy_ready_s_runs`` (every run's ``ready_s``, sorted) and
    ``ready_s`` (the median's)."""
    runs = sorted((recover(state, shm, sizes, "lazy") for _ in range(repeats)),
                  key=lambda r: r["ready_s"])
    median = runs[len(runs) // 2]
    return {"lazy": median, "lazy_ready_s_runs": [r["ready_s"] for r in runs],
            "ready_s": median["ready_s"]}
