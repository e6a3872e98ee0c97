"""Cache-core benchmark: one request at a time through open / extend / commit / release.

Prints one JSON object. Per request: ``open`` at admission (hash, match, pin, allocate, evict
when short); at finish the sequence is extended by output − 1 tokens (``extend``, decode-time
allocation), then ``commit`` and ``release``. ``per_request_us`` is the sum of the open, commit
and release medians (what SGLang's match + admit + insert + free costs); extend is reported
beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from prefixd.cache import PrefixCache  # noqa: E402
from prefixd.workloads import WORKLOADS, ideal_hit_rate, working_set_tokens  # noqa: E402


def _pct(values: list[int], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] / 1000


def run(workload: str, block_size: int = 16, pool_fraction: float = 0.5, policy: str = "lru",
        profile: bool = False) -> dict:
    reqs = WORKLOADS[workload]()
    ws = working_set_tokens(reqs, block_size)
    num_blocks = int(ws * pool_fraction) // block_size
    cache = PrefixCache(num_blocks, block_size, policy=policy)
    times = {"open": [], "extend": [], "commit": [], "release": []}
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        for req in reqs:
            t0 = clock()
            seq = cache.open(req.prompt)
            t1 = clock()
            cache.extend(seq.id, req.output[:-4])
            t2 = clock()
            cache.commit(seq.id)
            t3 = clock()
            cache.release(seq.id)
            t4 = clock()
            cache.events.clear()
            times["open"].append(t1 - t0)
            times["extend"].append(t2 - t1)
            times["commit"].append(t3 - t2)
            times["release"].append(t4 - t3)
    finally:
        gc.enable()
    if prof is not None:
        prof.disable()
        import pstats

        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    ops = {name: {"median_us": statistics.median(v) / 1000, "p99_us": _pct(v, 0.99)}
           for name, v in times.items()}
    evicted_tokens = cache.stats.evicted_blocks * block_size
    ops["evict"] = {
        "blocks": cache.stats.evicted_blocks,
        "ns_per_token": cache.stats.evict_ns / evicted_tokens if evicted_tokens else 0.0,
    }
    per_request = sum(ops[n]["median_us"] for n in ("open", "commit", "release"))
    return {
        "workload": workload,
        "requests": len(reqs),
        "block_size": block_size,
        "policy": policy,
        "working_set_tokens": ws,
        "pool_blocks": num_blocks,
        "pool_fraction": pool_fraction,
        "hit_rate": round(cache.stats.hit_rate, 4),
        "ideal_hit_rate": round(ideal_hit_rate(reqs, block_size), 4),
        "ops": ops,
        "per_request_us": round(per_request, 2),
        "per_request_with_extend_us": round(per_request + ops["extend"]["median_us"], 2),
        "peers": {"sglang_radix_cache_us": {"gsp": 200, "multiturn": 260}[workload],
                  "vllm_kv_cache_manager_us": {"gsp": 430}.get(workload)},
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gsp")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.5)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--profile", action="store_true", help="cProfile to stderr")
    parser.add_argument("--json", action="store_true", help="print JSON (the default output)")
    args = parser.parse_args()
    result = run(args.workload, args.block_size, args.pool_fraction, args.policy, args.profile)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
