"""`make demo`: what prefixd does today, end to end, in one screen.

First runs the in-process cache core on the ``gsp`` workload (DESIGN.md "Benchmarks") with a
device pool half the working set, and prints a table: requests, hit rate against the ideal,
evictions, and per-operation latency. Then serves a small workload with the durable cache
(three tiers, WAL) in a child process, kills it with SIGKILL, recovers, and shows that every
acknowledged prefix is still a hit with byte-identical KV (``prefixd.tools.demo_kill9``).
"""

from __future__ import annotations

import argparse
import time

from prefixd.cache import PrefixCache
from prefixd.tools.driver import replay, summarize
from prefixd.tools.workloads import WORKLOADS, ideal_hit_rate, working_set_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixd.tools.demo", description=__doc__)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gsp")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-crash", action="store_true", help="skip the kill -9 / recovery part")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    reqs = WORKLOADS[args.workload]()
    ws = working_set_tokens(reqs, args.block_size)
    num_blocks = ws // 2 // args.block_size
    cache = PrefixCache(num_blocks, args.block_size)
    ops = summarize(replay(cache, reqs))
    cache.check_invariants()
    ideal = ideal_hit_rate(reqs, args.block_size)
    s = cache.stats
    rows = [
        ("workload", f"{args.workload} ({len(reqs)} requests, block {args.block_size})"),
        ("working set", f"{ws:,} tokens; device pool {num_blocks:,} blocks (50%)"),
        ("hit rate", f"{s.hit_rate:.4f} (ideal {ideal:.4f})"),
        ("tokens served from cache", f"{s.hit_tokens:,} of {s.requested_tokens:,}"),
        ("blocks evicted", f"{s.evicted_blocks:,}"),
        ("blocks indexed", f"{s.committed_blocks:,}"),
    ]
    for name in ("open", "extend", "commit", "release"):
        rows.append((f"{name} latency", f"median {ops[name]['median_us']:.1f} µs, p99 {ops[name]['p99_us']:.1f} µs"))
    per_req = sum(ops[n]["median_us"] for n in ("open", "commit", "release"))
    rows.append(("per request", f"{per_req:.1f} µs (open + commit + release medians)"))
    rows.append(("invariants", "checked: OK"))
    _table("prefixd cache core: in-process replay", rows)
    if not args.no_crash:
        from prefixd.tools import demo_kill9 as demo_crash

        _table("prefixd durable cache: serve, kill -9, recover", demo_crash.run())
    print(f"(ran in {time.perf_counter() - t0:.1f} s)")
    return 0


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(title)
    print("-" * (width + 60))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()


if __name__ == "__main__":
    raise SystemExit(main())
