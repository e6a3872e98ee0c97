"""Cache-core benchmark: one request at a time through open / extend / commit / release.

Prints one JSON object. Per request: ``open`` at admission (hash, match, pin, allocate, evict
when short); at finish the sequence is extended by output − 1 tokens (``extend``, decode-time
allocation), then ``commit`` and ``release``. ``per_request_us`` is the sum of the open, commit
and release medians (what SGLang's match + admit + insert + free costs); extend is reported
beside it.

With ``make bench-peers`` done (or ``--sglang-path`` naming an install), the same requests also
run through SGLang's ``RadixCache`` in the same process (``bench/peers/sglang_radix.py``), and
``peers.sglang_radix_cache`` holds its medians and the ratio ``prefixd / sglang``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from prefixd.cache import PrefixCache  # noqa: E402
from prefixd.tools.driver import replay, summarize  # noqa: E402
from prefixd.tools.workloads import WORKLOADS, ideal_hit_rate, working_set_tokens  # noqa: E402


def run(workload: str, block_size: int = 16, pool_fraction: float = 0.5, policy: str = "lru",
        profile: bool = False, sglang_path: str | None = None) -> dict:
    reqs = WORKLOADS[workload]()
    ws = working_set_tokens(reqs, block_size)
    num_blocks = int(ws * pool_fraction) // block_size
    cache = PrefixCache(num_blocks, block_size, policy=policy)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    times = replay(cache, reqs)
    if prof is not None:
        prof.disable()
        import pstats

        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    ops = summarize(times)
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
        "peers": {"sglang_radix_cache": _sglang(reqs, num_blocks, block_size, per_request, sglang_path)},
        "python": sys.version.split()[0],
    }


def _sglang(reqs, num_blocks: int, block_size: int, ours_us: float, path: str | None) -> dict:
    """SGLang's RadixCache on the same requests and pool, in this run (or why not)."""
    from bench.peers import sglang_radix

    rc = sglang_radix.load(path)
    if rc is None:
        return {"measured": False, "why": "SGLang not installed: make bench-peers"}
    times, hit_rate = sglang_radix.replay(rc, reqs, num_blocks, block_size)
    ops = summarize(times)
    per_request = sum(ops[n]["median_us"] for n in ("open", "commit", "release"))
    return {"measured": True, "ops": ops, "hit_rate": round(hit_rate, 4),
            "per_request_us": round(per_request, 2),
            "prefixd_over_sglang": round(ours_us / per_request, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gsp")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.5)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--profile", action="store_true", help="cProfile to stderr")
    parser.add_argument("--sglang-path", help="where SGLang is installed (default bench/out/sglang)")
    parser.add_argument("--json", action="store_true", help="print JSON (the default output)")
    args = parser.parse_args()
    result = run(args.workload, args.block_size, args.pool_fraction, args.policy, args.profile,
                 args.sglang_path)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
