"""Storage tier benchmark: bandwidth of each movement path against a floor measured in the same run.

    python bench/tiers.py --json [--state-dir DIR] [--reps 5] [--batches 4] [--batch-blocks 64]

Prints one JSON object. Each section is a function ``section(args) -> dict`` registered in
``SECTIONS``: ``bandwidth`` and ``hit_rate``.

bandwidth.<path>: ``gbps`` (median over reps), ``floor_gbps`` (median), ``ratio`` (median of the
per-rep ratios, floor and path measured back to back in alternating order), best values too.
  demote_device_host   copy(DEVICE -> HOST) incl. checksums   vs  torch copy_ of a contiguous tensor
  spill_host_disk      copy(HOST -> DISK, durable=True)       vs  pwrite + fsync of one file
  promote_disk_device  cold copy(DISK -> DEVICE, verify=...)  vs  cold sequential pread of one file
Slots are shuffled (what a pool looks like after churn): no run coalescing helps us.

hit_rate.<workload>: ``tiered`` (device 10%, host 40%, disk 150% of the working set),
``device_only`` (device 10%), ``ideal`` (infinite cache), ``tiered_vs_ideal``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prefixd.api.layout import KVLayout  # noqa: E402
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore  # noqa: E402

LAYOUT = KVLayout("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)


def _drop_caches(paths: list[str]) -> str:
    """Make the next read of ``paths`` cold; returns which method worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise_dontneed"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _summary(ours: list[float], floor: list[float], nbytes: int, extra: dict) -> dict:
    gbps = [nbytes / t / 1e9 for t in ours]
    fl = [nbytes / t / 1e9 for t in floor]
    return {
        "gbps": round(statistics.median(gbps), 3), "floor_gbps": round(statistics.median(fl), 3),
        "ratio": round(statistics.median(g / f for g, f in zip(gbps, fl)), 3),
        "best_gbps": round(max(gbps), 3), "best_floor_gbps": round(max(fl), 3),
        "bytes_per_rep": nbytes, **extra,
    }


def bandwidth(args) -> dict:
    n_batch, n_blocks = args.batches, args.batch_blocks
    total = n_batch * n_blocks
    nbytes = total * LAYOUT.block_bytes
    rng = random.Random(0)
    state = args.state_dir or tempfile.mkdtemp(prefix="prefixd-bench-", dir="/var/tmp")
    os.makedirs(state, exist_ok=True)
    store = TierStore(LAYOUT, {Tier.DEVICE: total, Tier.HOST: total, Tier.DISK: total}, state_dir=state,
                      shm_dir=args.shm_dir, name="bench-tiers", fresh=True)
    out: dict = {}
    try:
        dev = store.pool(Tier.DEVICE).tensor
        gen = torch.Generator().manual_seed(0)
        for b in range(0, total, 16):
            dev[b:b + 16].copy_(torch.randn(dev[b:b + 16].shape, generator=gen).to(dev.dtype))

        def batches():
            perm = rng.sample(range(total), total)
            return [perm[i:i + n_blocks] for i in range(0, total, n_blocks)]

        # floors work on one contiguous batch-set of the same bytes
        src = torch.empty(total, LAYOUT.block_numel, dtype=LAYOUT.torch_dtype()).copy_(dev.view(total, -1))
        dst = torch.empty_like(src).zero_()
        flat = src.view(torch.uint8).numpy().reshape(-1)
        floor_path = os.path.join(state, "floor.bin")
        fd = os.open(floor_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, 4096 + nbytes)
        step = n_blocks * LAYOUT.block_bytes

        def floor_copy():
            for i in range(n_batch):
                dst[i * n_blocks:(i + 1) * n_blocks].copy_(src[i * n_blocks:(i + 1) * n_blocks])

        def floor_write():
            for i in range(n_batch):
                os.pwrite(fd, flat[i * step:(i + 1) * step], 4096 + i * step)
                os.fsync(fd)

        def floor_read():
            view = dst.view(torch.uint8).numpy().reshape(-1)
            for i in range(n_batch):
                os.preadv(fd, [view[i * step:(i + 1) * step]], 4096 + i * step)

        sums: dict[int, int] = {}

        def demote():
            for d, h in zip(batches(), batches()):
                store.copy(Tier.DEVICE, d, Tier.HOST, h)

        def spill():
            for h, k in zip(batches(), batches()):
                res = store.copy(Tier.HOST, h, Tier.DISK, k, durable=True)
                sums.update(zip(k, res.checksums))

        def promote():
            for k, d in zip(batches(), batches()):
                res = store.copy(Tier.DISK, k, Tier.DEVICE, d, verify=[sums[s] for s in k])
                assert all(res.ok), "a block failed its checksum in the benchmark"

        paths = [floor_path, store.pool(Tier.DISK).path]
        cold = {"method": None}

        def run(name, ours_fn, floor_fn, prep=None):
            ours, floor = [], []
            ours_fn(), floor_fn()  # warm up: first touches, extent conversion, thread start
            for rep in range(args.reps):
                pair = [(ours, ours_fn), (floor, floor_fn)]
                for acc, fn in pair if rep % 2 == 0 else reversed(pair):
                    if prep:
                        cold["method"] = prep(paths)
                    acc.append(_timed(fn))
            return ours, floor

        wanted = args.paths.split(",")
        if "demote_device_host" in wanted:
            o, f = run("demote", demote, floor_copy)
            out["demote_device_host"] = _summary(o, f, nbytes, {"floor": "torch copy_ of a contiguous tensor"})
        if "spill_host_disk" in wanted or "promote_disk_device" in wanted:
            o, f = run("spill", spill, floor_write)
            out["spill_host_disk"] = _summary(o, f, nbytes, {"floor": "pwrite + fsync of one file, per batch",
                                                             "durable": "fdatasync per batch"})
        if "promote_disk_device" in wanted:
            o, f = run("promote", promote, floor_read, prep=_drop_caches)
            out["promote_disk_device"] = _summary(o, f, nbytes, {"floor": "cold sequential preadv of one file",
                                                                 "cold": cold["method"], "verified": True})
        os.close(fd)
        os.unlink(floor_path)
    finally:
        store.close()
        for t in ("device", "host"):
            p = os.path.join(args.shm_dir, f"bench-tiers.{t}.pool")
            if os.path.exists(p):
                os.unlink(p)
        p = os.path.join(state, "bench-tiers.disk.pool")
        if os.path.exists(p):
            os.unlink(p)
        if not args.state_dir:
            os.rmdir(state)
    return {
        "layout": {"model_id": LAYOUT.model_id, "block_bytes": LAYOUT.block_bytes, "dtype": LAYOUT.dtype},
        "batch_blocks": n_blocks, "batches_per_rep": n_batch, "reps": args.reps, "slots": "shuffled",
        "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
        "loadavg_1m_after": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), **out,
    }


def hit_rate(args) -> dict:
    """Hit rates with device 10%, host 40%, disk 150% of the working set (write_through), and
    with the device alone at 10%, against the ideal (an infinite cache), per workload.

    Index only (no bytes move): the hit rate is a property of the policy, and moving ~1 GiB of
    KV per workload would time the disk, which ``bandwidth`` already does.
    """
    from prefixd.cache import PrefixCache
    from prefixd.tools.driver import replay
    from prefixd.tools.workloads import WORKLOADS, ideal_hit_rate, working_set_tokens

    out = {}
    bs = 16
    for name in args.workloads.split(","):
        reqs = WORKLOADS[name]()
        ws_blocks = working_set_tokens(reqs, bs) // bs
        sizes = (ws_blocks // 10, ws_blocks * 4 // 10, ws_blocks * 15 // 10)
        tiered = PrefixCache(sizes, bs)
        replay(tiered, reqs)
        tiered.check_invariants()
        device_only = PrefixCache(sizes[0], bs)
        replay(device_only, reqs)
        _, host, disk = tiered.stats.hit_tokens_by_tier
        total = tiered.stats.requested_tokens
        out[name] = {
            "tiered": round(tiered.stats.hit_rate, 4),
            "device_only": round(device_only.stats.hit_rate, 4),
            "ideal": round(ideal_hit_rate(reqs, bs), 4),
            "tiered_served_from": {"device": round(tiered.stats.hit_rate - (host + disk) / total, 4),
                                   "host": round(host / total, 4), "disk": round(disk / total, 4)},
            "blocks": {"device": sizes[0], "host": sizes[1], "disk": sizes[2], "working_set": ws_blocks},
        }
        out[name]["tiered_vs_ideal"] = round(out[name]["tiered"] / out[name]["ideal"], 4)
    return out


SECTIONS = {"bandwidth": bandwidth, "hit_rate": hit_rate}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    ap.add_argument("--state-dir", default=None, help="where the disk pool goes (default: a temp dir under /var/tmp, removed after)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4, help="batches per rep")
    ap.add_argument("--batch-blocks", type=int, default=64)
    ap.add_argument("--paths", default="demote_device_host,spill_host_disk,promote_disk_device",
                    help="bandwidth paths to run (comma-separated)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ",".join(SECTIONS))
    ap.add_argument("--workloads", default="gsp,multiturn", help="hit_rate workloads (comma-separated)")
    args = ap.parse_args(argv)
    result = {"bench": "tiers"}
    for name in args.sections.split(","):
        result[name] = SECTIONS[name](args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
