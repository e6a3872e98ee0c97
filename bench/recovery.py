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
before (it fires at 500k decoded blocks, ~15k records), so no restart under the defaults
replays it; it is kept as a stress case, not the headline. The page cache is dropped (root only; ``page_cache_dropped`` says whether it was),
then a FRESH Python process opens the state directory: it stamps the time on its first line,
imports ``prefixd``, and constructs ``DurableCache`` (the constructor is recovery); its
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
unbounded, as before) and once with the default (``default``); for each: the tail's records
and blocks (``tail_blocks``), checkpoints taken while serving and their time, and the cold lazy
recovery (``ready_s``: median of ``--long-repeats``).

Usage: ``python bench/recovery.py --json [--sizes 10000,100000,1000000] [--tail 100000]
[--long-size 1000000] [--wal-reps 7]`` (``--sizes ""``, ``--tail 0``, ``--long-size 0``,
``--wal-reps 0`` skip a part).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from prefixd.api.layout import KVLayout  # noqa: E402
from prefixd.engine.durable import DurableCache  # noqa: E402
from prefixd.engine.records import CHECKPOINT_BLOCKS  # noqa: E402
from prefixd.wal import Kind  # noqa: E402

BLOCK_SIZE = 16
LAYOUT = KVLayout("bench-tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32",
                  block_size=BLOCK_SIZE)
DEVICE_BLOCKS = 2048
HOST_BLOCKS = 8192
VOCAB = 128256

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


class Traffic:
    """Seeded request generator: system prompts, conversations branching off them, turns."""

    def __init__(self, seed: int, num_systems: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.systems = [self.tokens(self.run_len()) for _ in range(num_systems)]
        self.convs: list[bytes] = []  # prompts served so far (prefixes to continue)

    def run_len(self, lo: int = 8, hi: int = 150) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def tokens(self, num_blocks: int) -> bytes:
        return self.rng.integers(0, VOCAB, num_blocks * BLOCK_SIZE, dtype="<i4").tobytes()

    def next_prompt(self, lo: int, hi: int, p_new: float) -> bytes:
        """A new conversation on a system prompt, or one more turn of an earlier one."""
        rng = self.rng
        if not self.convs or rng.random() < p_new:
            base = self.systems[int(rng.integers(len(self.systems)))]
        else:
            base = self.convs[int(rng.integers(len(self.convs)))]
            if len(base) > 600 * BLOCK_SIZE * 4:  # keep prompts within the device tier
                base = base[: 300 * BLOCK_SIZE * 4]
        prompt = base + self.tokens(self.run_len(lo, hi)) + self.tokens(1)[:4 * 3]  # + 3 loose tokens
        self.convs.append(prompt)
        if len(self.convs) > 4096:
            self.convs = self.convs[-2048:]
        return prompt


def serve(dc: DurableCache, prompt: bytes) -> None:
    seq = dc.open(prompt)
    dc.commit(seq.id, "index").result()
    dc.release(seq.id)


def default_trigger() -> tuple[int, int]:
    """The engine's default checkpoint trigger: ``(checkpoint_records, checkpoint_blocks)``."""
    params = inspect.signature(DurableCache).parameters
    return params["checkpoint_records"].default, params["checkpoint_blocks"].default


def build(state: str, shm: str, n: int, tail: int | None, seed: int = 0) -> dict:
    """Build a state dir: n blocks in the checkpoint, then a tail after it: ``tail`` records
    exactly, or (``tail=None``) as long as the engine's default checkpoint trigger allows, up
    to the engine call that makes it fire (its checkpoint is skipped, as a crash right then
    would skip it)."""
    disk = n + max(n // 20, 20_000)
    sizes = (DEVICE_BLOCKS, HOST_BLOCKS, disk)
    traffic = Traffic(seed, num_systems=max(8, n // 5000))
    t0 = time.perf_counter()
    dc = DurableCache(state, LAYOUT, sizes, shm_dir=shm, sync="none", checkpoint_records=1 << 60,
                      checkpoint_blocks=1 << 60, spill_blocks=4096)
    tree = dc.cache.tree
    requests = 0
    tiering = dc.cache.tiering
    best, best_at = 0, 0
    while (have := tree.num_blocks_in[2] + sum(node.num_blocks for node in tiering.pending_disk)) < n:
        serve(dc, traffic.next_prompt(8, 150, p_new=0.5))
        requests += 1
        if len(tiering.pending_disk) >= 64:
            dc.spill()
        if have > best:
            best, best_at = have, requests
        elif requests - best_at > 5000:  # a bounded loop: the disk tier stopped filling
            raise RuntimeError(f"build stalled at {have} of {n} disk blocks (disk tier {disk}) "
                               f"after {requests} requests: something keeps disk slots empty")
    dc.spill()
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ckpt_lsn = dc.checkpoint()
    checkpoint_write_s = time.perf_counter() - t1
    ckpt_blocks = list(tree.num_blocks_in)
    ckpt_nodes = sum(1 for _ in tree.nodes())
    # the tail: shorter new turns (a chat's next question), re-opens of cached prefixes
    counts: dict[str, int] = {}
    tail_requests = 0
    if tail is None:
        tail_requests = default_tail(dc, traffic)
    else:
        while dc.wal.stats().next_lsn - 1 - ckpt_lsn < tail - 40:
            serve(dc, traffic.next_prompt(1, 24, p_new=0.3))
            tail_requests += 1
            if tail_requests % 50 == 0:
                dc.spill()
        dc._log()
        extra = tail - (dc.wal.stats().next_lsn - 1 - ckpt_lsn)
        for _ in range(max(extra, 0)):  # top up to exactly ``tail`` with cheap lookups turned opens
            seq = dc.open(traffic.systems[0][: 4 * BLOCK_SIZE * 2 + 4])
            dc.release(seq.id)
            if dc.wal.stats().next_lsn - 1 - ckpt_lsn >= tail:
                break
    dc._log()
    tail_records, tail_blocks = log_tail(dc, ckpt_lsn, counts)
    final_blocks = list(tree.num_blocks_in)
    dc.close()
    return {"sizes": list(sizes), "tail": "default_trigger" if tail is None else f"{tail} records",
            "build_s": round(build_s, 2), "build_requests": requests,
            "checkpoint_write_s": round(checkpoint_write_s, 3),
            "checkpoint_blocks_by_tier": ckpt_blocks, "checkpoint_nodes": ckpt_nodes,
            "tail_records": tail_records, "tail_blocks": tail_blocks, "tail_requests": tail_requests,
            "tail_kinds": counts, "blocks_by_tier_at_close": final_blocks}


def default_tail(dc: DurableCache, traffic: Traffic) -> int:
    """Serve tail traffic under the engine's default checkpoint trigger until it fires; the
    checkpoint it asks for is not taken (a crash before it leaves this tail). Returns the
    requests served (the last one may stop half way: open, commit or release)."""
    dc.checkpoint_records, dc.checkpoint_blocks = default_trigger()
    fired = []
    dc.checkpoint = lambda: fired.append(1)  # the trigger's call, skipped (see the docstring)
    requests = 0
    while not fired:
        seq = dc.open(traffic.next_prompt(1, 24, p_new=0.3))
        if not fired:
            dc.commit(seq.id, "index").result()
        if not fired:
            dc.release(seq.id)
        requests += 1
        if not fired and requests % 50 == 0:
            dc.spill()
    return requests


def log_tail(dc: DurableCache, after_lsn: int, counts: dict | None = None) -> tuple[int, int]:
    """``(records, blocks named by block records)`` in the log after ``after_lsn``."""
    records = blocks = 0
    block_kinds = (Kind.BLOCK_PUT, Kind.BLOCK_MOVE, Kind.BLOCK_DROP)
    for rec in dc.wal.replay(after_lsn):
        records += 1
        if rec.kind in block_kinds:
            blocks += rec.fields[1]
        if counts is not None:
            counts[rec.kind.name] = counts.get(rec.kind.name, 0) + 1
    return records, blocks


class LongTraffic:
    """Long prompts (~``prompt_tokens``): a shared system prompt and a new document, or a new
    question about a document already served (a long cached prefix)."""

    def __init__(self, seed: int, prompt_tokens: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.system = self.tokens(64)
        self.doc_blocks = max(1, prompt_tokens // BLOCK_SIZE - 64 - 16)
        self.docs: list[bytes] = []

    def tokens(self, num_blocks: int) -> bytes:
        return self.rng.integers(0, VOCAB, num_blocks * BLOCK_SIZE, dtype="<i4").tobytes()

    def next_prompt(self) -> bytes:
        rng = self.rng
        if self.docs and rng.random() < 0.3:
            base = self.docs[int(rng.integers(len(self.docs)))]
        else:
            base = self.system + self.tokens(self.doc_blocks)
            self.docs.append(base)
            if len(self.docs) > 512:
                self.docs = self.docs[-256:]
        return base + self.tokens(int(rng.integers(4, 17))) + self.tokens(1)[:4 * 3]


def build_long(state: str, shm: str, n: int, prompt_tokens: int, checkpoint_blocks: int,
               seed: int = 0) -> dict:
    """Serve long prompts with the engine's own checkpoint trigger until about ``n`` blocks
    went to disk and a third more (the disk tier full and evicting), then close without a
    checkpoint: what a crash would leave."""
    sizes = (DEVICE_BLOCKS, HOST_BLOCKS, n)
    traffic = LongTraffic(seed, prompt_tokens)
    dc = DurableCache(state, LAYOUT, sizes, shm_dir=shm, sync="none", checkpoint_blocks=checkpoint_blocks)
    checkpoints = []
    taken = dc.checkpoint

    def counted() -> int:
        t = time.perf_counter()
        lsn = taken()
        checkpoints.append(time.perf_counter() - t)
        return lsn

    dc.checkpoint = counted
    t0 = time.perf_counter()
    requests = stored = 0
    while stored < n * 4 // 3:
        before = dc.cache.stats.committed_blocks
        serve(dc, traffic.next_prompt())
        stored += dc.cache.stats.committed_blocks - before
        requests += 1
    serve_s = time.perf_counter() - t0
    dc._log()
    ckpt_lsn = dc.wal.with_checkpoint(lambda lsn, index, seqs: lsn)
    tail_records, tail_blocks = log_tail(dc, ckpt_lsn)
    final_blocks = list(dc.cache.tree.num_blocks_in)
    dc.close()
    return {"sizes": list(sizes), "checkpoint_blocks": checkpoint_blocks, "requests": requests,
            "blocks_committed": stored, "serve_s": round(serve_s, 2),
            "checkpoints": len(checkpoints), "checkpoint_s_total": round(sum(checkpoints), 2),
            "tail_records": tail_records, "tail_blocks": tail_blocks,
            "blocks_by_tier_at_close": final_blocks}


def long_section(root: str, shm: str, n: int, prompt_tokens: int, repeats: int) -> dict:
    """The long-prompt case, with the records-only trigger (as before) and the default one."""
    out = {"prompt_tokens": prompt_tokens, "cache_blocks": n}
    for name, bound in (("records_only", 1 << 60), ("default", CHECKPOINT_BLOCKS)):
        state = os.path.join(root, f"long-{name}")
        shm_n = os.path.join(shm, f"long-{name}")
        os.makedirs(shm_n)
        built = build_long(state, shm_n, n, prompt_tokens, bound)
        runs = sorted((recover(state, shm_n, built["sizes"], "lazy") for _ in range(repeats)),
                      key=lambda r: r["ready_s"])
        out[name] = {"build": built, "lazy": runs[len(runs) // 2],
                     "lazy_ready_s_runs": [r["ready_s"] for r in runs],
                     "ready_s": runs[len(runs) // 2]["ready_s"], "tail_blocks": built["tail_blocks"]}
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
    entry = {"build": built}
    # each recovery appends one RECOVER record: the tail grows by one per run
    runs = [recover(state, shm_n, built["sizes"], "lazy") for _ in range(repeats)]
    runs.sort(key=lambda r: r["ready_s"])
    entry["lazy"] = runs[len(runs) // 2]  # the median run, all its phases
    entry["lazy_ready_s_runs"] = [r["ready_s"] for r in runs]
    entry["ready_s"] = entry["lazy"]["ready_s"]
    if eager:
        entry["eager"] = recover(state, shm_n, built["sizes"], "eager")
        entry["eager_ready_s"] = entry["eager"]["ready_s"]
    if not keep:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(shm_n, ignore_errors=True)
    return entry


def drop_page_cache() -> bool:
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
    for k in ("open_s", "checkpoint_load_s", "replay_s", "reconcile_s"):
        result[k] = round(rec[k], 4)
    result["recover_record_s"] = round(rec["ready_s"] - sum(rec[k] for k in ("open_s", "checkpoint_load_s", "replay_s", "reconcile_s")), 4)
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


def wal_section(reps: int, records: int) -> dict:
    """``bench/wal.py``'s floor and wal loops at 64 records per commit, alternating."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
