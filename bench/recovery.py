"""Recovery time (process start -> ready) with 10k / 100k / 1M cached blocks, and WAL throughput.

For each n: a state directory is built through ``DurableCache`` itself (the same code that serves
requests, ``sync="none"`` and ``durability="index"`` to build fast): shared system prompts
(8-150 blocks) with many conversations branching off them and further turns branching off
those (8-150 blocks each), written through to a disk tier until n blocks are cached; a
checkpoint is taken (``checkpoint_write_s``); then a tail of realistic traffic (new turns,
re-opens of cached prefixes, commits of new blocks, releases, device/host/disk evictions) is
appended after it, and the cache is closed without another checkpoint.

Which tail. ``recovery.<n>`` (the headline) serves that traffic under the engine's DEFAULT
checkpoint trigger (``checkpoint_records`` records or ``checkpoint_blocks`` blocks that replay
decodes, whichever comes first, read from ``DurableCache``'s own defaults) until the trigger
fires, and skips the checkpoint it asks for: the largest tail a restart under the default
configuration can meet (a crash just before that checkpoint; one engine call past the
threshold). ``forced_tail.<n>`` forces exactly ``--tail`` (100k) records whatever they name:
with this traffic 100k records name ~3.5M blocks, a tail the default trigger folds long
before (it fires at 500k decoded blocks: 45k-74k records of this traffic, by pool size), so
no restart under the defaults replays it; it is kept as a stress case, not the headline. The
page cache is dropped (root only; ``page_cache_dropped`` says whether it was), then a FRESH
Python process opens the state directory: it stamps the time on its first line, imports
``prefixd``, and constructs ``DurableCache`` (the constructor is recovery); its
``recovery`` phases come back as JSON. Done with ``verify="lazy"`` and ``"eager"``.

``recovery.<n>.ready_s`` is the median of ``--repeats`` (5) such recoveries with lazy verify
(all of them in ``lazy_ready_s_runs``; eager verify runs once): the constructor's own clock
(open -> ready), split into ``open_s``,
``checkpoint_load_s``, ``replay_s``, ``reconcile_s`` (+ the RECOVER record). Interpreter
start-up and imports (torch, via the storage tiers) are reported beside it, not inside it:
``process_to_ready_s`` = parent's clock before spawning -> constructor returned.

The KV layout is tiny (1 layer, 1 head, head_dim 2, float32, 16 tokens per block: 256 B per
block), so pool files stay small: this bench is about the index, not the bytes.

``wal``: ``bench/wal.py``'s floor and wal loops at 64 records per durable commit, in this run.

``long_prompt``: prompts of ~12k tokens (``--long-prompt-tokens``: a shared system prompt and a
new document, or a new question on a document already served) through a cache of
``--long-size`` disk blocks with the engine's own checkpoint trigger, served until a third more
blocks than the disk holds were committed, then closed without a checkpoint (as a crash would
leave it). Once with the trigger of records alone (``records_only``: ``checkpoint_blocks``
unbounded) and once with the default (``default``); for each: the tail's records
and blocks (``tail_blocks``), checkpoints taken while serving and their time, and the cold lazy
recovery (``ready_s``: median of ``--long-repeats``).

Its parts live in ``bench/recovery_parts/``: ``recovery_state.py`` (the traffic and the builds
of a state directory) and ``recovery_restart.py`` (a cold restart in a fresh process and its
timings); this file runs the cases and prints the JSON.

Usage: ``python bench/recovery.py --json [--sizes 10000,100000,1000000] [--tail 100000]
[--long-size 1000000] [--wal-reps 7]`` (``--sizes ""``, ``--tail 0``, ``--long-size 0``,
``--wal-reps 0`` skip a part).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(BENCH, ".."))
sys.path.insert(0, os.path.join(BENCH, "recovery_parts"))  # its parts: the state, the restart

from prefixd.engine.records import CHECKPOINT_BLOCKS  # noqa: E402
from recovery_restart import lazy_recoveries, recover  # noqa: E402 - recovery_parts/ on the path first
from recovery_state import DEVICE_BLOCKS, HOST_BLOCKS, build, build_long, default_trigger  # noqa: E402


def long_section(root: str, shm: str, n: int, prompt_tokens: int, repeats: int) -> dict:
    """The long-prompt case, with the records-only trigger and the default one."""
    out = {"prompt_tokens": prompt_tokens, "cache_blocks": n}
    for name, bound in (("records_only", 1 << 60), ("default", CHECKPOINT_BLOCKS)):
        state = os.path.join(root, f"long-{name}")
        shm_n = os.path.join(shm, f"long-{name}")
        os.makedirs(shm_n)
        built = build_long(state, shm_n, n, prompt_tokens, bound)
        out[name] = {"build": built, **lazy_recoveries(state, shm_n, built["sizes"], repeats),
                     "tail_blocks": built["tail_blocks"]}
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(shm_n, ignore_errors=True)
    return out


def size_case(root: str, shm: str, n: int, tail: int | None, repeats: int, keep: bool,
              eager: bool) -> dict:
    """Build n blocks and a tail (``build``), then ``repeats`` cold lazy recoveries (and one
    eager): ``ready_s`` is the lazy median."""
    name = f"{n}-default" if tail is None else f"{n}-tail{tail}"
    state = os.path.join(root, f"state{name}")
    shm_n = os.path.join(shm, name)
    os.makedirs(shm_n)
    built = build(state, shm_n, n, tail)
    entry = {"build": built, **lazy_recoveries(state, shm_n, built["sizes"], repeats)}
    if eager:
        entry["eager"] = recover(state, shm_n, built["sizes"], "eager")
        entry["eager_ready_s"] = entry["eager"]["ready_s"]
    if not keep:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(shm_n, ignore_errors=True)
    return entry


def wal_section(reps: int, records: int) -> dict:
    """``bench/wal.py``'s floor and wal loops at 64 records per commit, alternating."""
    sys.path.insert(0, BENCH)
    import wal as walbench

    from prefixd.wal import encode

    recs = walbench.make_records(records)
    values = [encode(k, f, b) for k, f, b in recs]
    root = tempfile.mkdtemp(prefix="prefixd-bench-recovery-wal-")
    floors, wals = [], []
    try:
        for i in range(reps):
            floors.append(walbench.floor_run(os.path.join(root, f"floor{i}"), values, 64))
            wals.append(walbench.wal_run(os.path.join(root, f"wal{i}"), recs, 64, 2)[0])
            shutil.rmtree(os.path.join(root, f"floor{i}"))
            shutil.rmtree(os.path.join(root, f"wal{i}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor, wal = statistics.median(floors), statistics.median(wals)
    return {"wal.records_per_s": round(wal), "wal.floor_records_per_s": round(floor),
            "wal.ratio": round(wal / floor, 3), "wal.group_size": 64, "wal.reps": reps,
            "wal.records_per_rep": records, "wal.window": 2,
            "wal.all_floor": [round(x) for x in floors], "wal.all_wal": [round(x) for x in wals]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--tail", type=int, default=100_000,
                    help="records of the forced-tail case, forced_tail.<n> (0: skip it)")
    ap.add_argument("--repeats", type=int, default=5, help="cold lazy recoveries per size (median reported)")
    ap.add_argument("--wal-reps", type=int, default=7)
    ap.add_argument("--wal-records", type=int, default=19_200)
    ap.add_argument("--dir", default=None, help="where state directories are built (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the state directories")
    ap.add_argument("--long-size", type=int, default=1_000_000,
                    help="disk blocks of the long-prompt case (0: skip it)")
    ap.add_argument("--long-prompt-tokens", type=int, default=12_000)
    ap.add_argument("--long-repeats", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    root = tempfile.mkdtemp(prefix="prefixd-bench-recovery-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="prefixd-bench-recovery-", dir="/dev/shm")
    result: dict = {"bench": "recovery",
                    "params": {"layout": "1 layer, 1 kv head, head_dim 2, float32, 16 tokens/block "
                                         "(256 B/block): tiny on purpose, the bench is about the index",
                               "device_blocks": DEVICE_BLOCKS, "host_blocks": HOST_BLOCKS,
                               "tail": "recovery.<n>: the largest tail the engine's default checkpoint "
                                       "trigger leaves (checkpoint_records, checkpoint_blocks = "
                                       f"{default_trigger()}); forced_tail.<n>: exactly "
                                       f"{args.tail} records whatever they name",
                               "wal_sync": "commit (recovery opens)",
                               "ready_s": "DurableCache() constructor: open -> ready (imports excluded; "
                                          "see import_s and process_to_ready_s); the median of "
                                          "`repeats` cold lazy recoveries, eager once",
                               "repeats": args.repeats,
                               "page_cache": "dropped before each recovery when root",
                               "host": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f} at start"}}
    try:
        for n in sizes:
            result[f"recovery.{n}"] = size_case(root, shm, n, None, args.repeats, args.keep, eager=True)
            if args.tail:
                result[f"forced_tail.{n}"] = size_case(root, shm, n, args.tail, args.repeats, args.keep,
                                                       eager=False)
        if args.long_size:
            result["long_prompt"] = long_section(root, shm, args.long_size, args.long_prompt_tokens,
                                                 args.long_repeats)
        if args.wal_reps:
            result["wal"] = wal_section(args.wal_reps, args.wal_records)
            result["wal.records_per_s"] = result["wal"]["wal.records_per_s"]
            result["wal.floor_records_per_s"] = result["wal"]["wal.floor_records_per_s"]
            result["wal.ratio"] = result["wal"]["wal.ratio"]
        result["host_load_at_end"] = round(os.getloadavg()[0], 2)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
