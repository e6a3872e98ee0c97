"""Cluster tier benchmark: promoting a prefix from a Redis Cluster vs a bare MGET, and
the hit rate a second host gets from what the first one served.

    python bench/cluster.py --json [--reps 11] [--groups 8] [--prompts 16]

Prints one JSON object (one run's numbers only). Starts its own 3-master Redis Cluster on loopback
(``prefixd.tools.redis_cluster``: maxmemory 512 MiB a node, ``allkeys-lru``) and engines with
``[engine.cluster]`` (timeout 2 s: this bench measures bandwidth, and on the loaded 2-core host a
node stalled past 500 ms within a run, which the store rightly answers as a miss).

fetch: a 2k-token prefix (2,048 + 1 tokens: 128 full blocks) served and written behind by engine
A, in the layout of SmolLM2-135M (30 layers x 3 KV heads x head dim 64, float16, block 16:
360 KiB a block, 45 MiB the prefix). Each rep, back to back in alternating order:
  floor.mget_gbps            the 128 values by a bare pipelined MGET (one per hash slot, every
                             master's batch sent before any reply is read) over redis-py
                             ``Connection``s with hiredis: the client the store uses, no checks
  floor.mget_nonatomic_gbps  the same keys by redis-py's own ``RedisCluster.mget_nonatomic``
  store.get_run_gbps         ``ClusterStore.get_run`` of the 128 blocks (checks included)
  remote.fetch_gbps          ``open`` of the prompt on engine B (its own state directory; it
                             never saw the prompt): get_run + indexing + the copy into B's
                             device pool + the commit with write-through, i.e. promotion into
                             the local tiers (as the engine does it: indexed at the device in
                             ``open``, written down by the daemon's next ``tick``, timed apart
                             as ``engine.tick_after_ms``)
``best.*``: the fastest rep of each (on a host this loaded, the best of N approximates the
unloaded cost better than a median); ``per_rep_ms`` lists every rep. Each rep fetches another prefix (A served ``reps`` + 1 of them; the extra one warms every
client's connections and slot map first). B is a warm host: its device pool (3 prefixes + 32
blocks) is full of 3 prefixes it computed itself, so pool pages are touched and every
promotion evicts, as on a serving host; a fresh pool would time first-touch page faults. Its
host and disk tiers are 2x and 4x the device's, as on a serving host (host RAM and disk hold
more than GPU memory): with three equal tiers, write-through keeps no more below than the
device holds, so each promotion first demoted its device victim (47 MB) inside the open. Medians over reps; ``*_vs_floor`` are medians of
per-rep ratios against the faster floor.

hit_rate: gsp (``--groups`` x ``--prompts``, 2,048-token system prompts, 128-token questions,
256-token outputs; layout 1 x 1 x 8 fp16 so bytes do not matter). Engine A serves every request
(open prompt + output less its last token, commit, release) and drains its write-behind; then a
fresh engine B opens every prompt in the same order.
  remote.hit_rate            B's cached tokens / prompt tokens
  remote.ideal_hit_rate      an infinite cache that saw A's requests, on B's (every whole block
                             of each prompt up to len - 1)
  local.ideal_hit_rate       an infinite cache on B's requests alone (no fleet: what B could
                             reach without the cluster)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402
from redis.cluster import ClusterNode, RedisCluster as RedisClusterClient  # noqa: E402
from redis.connection import Connection  # noqa: E402
from redis.crc import key_slot  # noqa: E402
from redis.retry import Retry  # noqa: E402
from redis.utils import HIREDIS_AVAILABLE  # noqa: E402

from prefixd.api.layout import KVLayout  # noqa: E402
from prefixd.api.tiers import Tier  # noqa: E402
from prefixd.engine import Engine, EngineConfig, Tenant, TierSizes  # noqa: E402
from prefixd.config.cluster_settings import ClusterConfig  # noqa: E402
from prefixd.storage.cluster import ClusterStore  # noqa: E402
from prefixd.tools.redis_cluster import RedisCluster  # noqa: E402
from prefixd.tools.workloads import gsp, ideal_hit_rate  # noqa: E402

BS = 16
SMOL = KVLayout("smollm2-135m-like", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                block_size=BS)
TINY = KVLayout("bench-cluster-tiny", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                block_size=BS)
TENANT = Tenant("bench", "salt-bench")
TIMEOUT_MS = 2000.0
PREFIX_TOKENS = 2048
WARM_PREFIXES = 3  # B serves 3 prefixes of its own first: a warm host, every promotion evicts
HOST_TO_DEVICE, DISK_TO_DEVICE = 2, 4  # tier sizes as on a serving host (module docstring)


def _config(nodes, shm_dir: str, sizes: TierSizes) -> EngineConfig:
    return EngineConfig(blocks=sizes, shm_dir=shm_dir, tenants=(TENANT,), sync="none",
                        cluster=ClusterConfig(nodes=tuple(nodes), timeout_ms=TIMEOUT_MS,
                                              retry_after_s=0.2))


def _serve(dc, tokens: bytes, rng: np.random.Generator | None) -> int:
    """Open, fill the uncached blocks (random bytes when ``rng``), commit, release."""
    seq = dc.open(tokens)
    if rng is not None:
        rows = dc.store.pool(Tier.DEVICE).raw.numpy()
        for i in range(seq.num_indexed, len(tokens) // 4 // BS):
            rows[seq.block_table[i]] = rng.integers(0, 256, rows.shape[1], dtype=np.uint8)
    dc.commit(seq.id, "index").result()
    dc.release(seq.id)
    return seq.cached_tokens


def _bare_mget(conns: dict[str, Connection], keys: list[bytes], owners: list[str]) -> int:
    """The floor: one MGET per hash slot, every node's batch sent first, then every reply read.

    The values are kept until every reply is in, as any fetch must (dropping each one at once
    would let the allocator hand the next reply the same cache-warm pages)."""
    by_slot: dict[tuple[str, int], list[bytes]] = {}
    for k, o in zip(keys, owners):
        by_slot.setdefault((o, key_slot(k)), []).append(k)
    groups: dict[str, list[tuple]] = {}
    for (o, _), ks in by_slot.items():
        groups.setdefault(o, []).append(("MGET", *ks))
    for o, cmds in groups.items():
        conns[o].send_packed_command(conns[o].pack_commands(cmds), check_health=False)
    values = []
    for o, cmds in groups.items():
        for _ in cmds:
            values.extend(conns[o].read_response())
    return sum(len(v) for v in values if v is not None)


def _owners(client: RedisClusterClient, keys: list[bytes]) -> list[str]:
    return [client.get_node_from_key(k).name for k in keys]


def fetch(cluster: RedisCluster, reps: int, work: str, prefix_tokens: int = PREFIX_TOKENS) -> dict:
    rng = np.random.default_rng(0)
    num_blocks = prefix_tokens // BS
    prompts = [rng.integers(0, 128256, prefix_tokens + 1, dtype=np.int32).astype("<i4").tobytes()
               for _ in range(reps + 1)]
    device = WARM_PREFIXES * num_blocks + 32
    sizes = TierSizes(device=device, host=HOST_TO_DEVICE * device, disk=DISK_TO_DEVICE * device)
    a_engine = Engine(os.path.join(work, "a"), _config(cluster.nodes, os.path.join(work, "shm-a"), sizes))
    b_engine = Engine(os.path.join(work, "b"), _config(cluster.nodes, os.path.join(work, "shm-b"), sizes))
    a, b = a_engine.pool(TENANT.name, SMOL), b_engine.pool(TENANT.name, SMOL)
    client = RedisClusterClient(startup_nodes=[ClusterNode(*n.split(":")) for n in cluster.nodes])
    conns = {n: Connection(host=n.split(":")[0], port=int(n.split(":")[1]), socket_read_size=1 << 20,
                           retry=Retry(NoBackoff(), 0), driver_info=None) for n in cluster.nodes}
    store = ClusterStore(cluster.nodes, a.cluster.namespace, timeout_s=TIMEOUT_MS / 1000.0)
    times: dict[str, list[float]] = {"floor": [], "nonatomic": [], "get_run": [], "open": [],
                                    "tick": []}
    promoted = []
    nbytes = num_blocks * SMOL.block_bytes
    try:
        for tokens in prompts:
            _serve(a, tokens, rng)
            assert a.cluster.drain(120.0), "engine A's write-behind did not drain"
        written = a.cluster.stats().get("remote_written", 0)
        for _ in range(WARM_PREFIXES):  # B's own prompts: every pool page touched, pools full
            _serve(b, rng.integers(0, 128256, prefix_tokens + 1, dtype=np.int32).astype("<i4").tobytes(), rng)
        b.cluster.drain(120.0)
        # Warm-up: B's and the floor's connections and slot maps, on the extra prompt.
        runs = []
        for tokens in prompts:
            hashes = a.cluster.fleet_hashes(tokens, b"", num_blocks)
            keys = [a.cluster.remote.key(h) for h in hashes]
            runs.append((tokens, hashes, [tokens[i * BS * 4:(i + 1) * BS * 4] for i in range(num_blocks)],
                         keys, _owners(client, keys)))
        tokens, hashes, token_ids, keys, owners = runs[-1]
        _bare_mget(conns, keys, owners)
        client.mget_nonatomic(keys)
        store.get_run(hashes, token_ids)
        b.release(b.open(tokens).id)
        for rep in range(reps):
            tokens, hashes, token_ids, keys, owners = runs[rep]

            def run_floor():
                t = time.perf_counter()
                got = _bare_mget(conns, keys, owners)
                times["floor"].append(time.perf_counter() - t)
                assert got >= nbytes, f"floor read {got} of {nbytes} bytes: keys missing"

            def run_nonatomic():
                t = time.perf_counter()
                values = client.mget_nonatomic(keys)
                times["nonatomic"].append(time.perf_counter() - t)
                assert all(v is not None for v in values)

            def run_store():
                t = time.perf_counter()
                run = store.get_run(hashes, token_ids)
                times["get_run"].append(time.perf_counter() - t)
                assert len(run) == num_blocks, f"get_run returned {len(run)} of {num_blocks}"

            def run_open():
                t = time.perf_counter()
                seq = b.open(tokens)
                times["open"].append(time.perf_counter() - t)
                promoted.append(seq.cached_tokens // BS)
                b.release(seq.id)
                t = time.perf_counter()
                b.tick()  # the daemon's next tick writes the promoted run down (not in the open)
                times["tick"].append(time.perf_counter() - t)

            steps = [run_floor, run_nonatomic, run_store, run_open]
            for step in (steps if rep % 2 == 0 else steps[::-1]):
                step()
    finally:
        store.close()
        client.close()
        for c in conns.values():
            c.disconnect()
        a_engine.close()
        b_engine.close()

    def gbps(ts):
        return [nbytes / t / 1e9 for t in ts]

    floor = gbps(times["floor"])
    nonatomic = gbps(times["nonatomic"])
    best_floor = [max(f, n) for f, n in zip(floor, nonatomic)]
    get_run, opened = gbps(times["get_run"]), gbps(times["open"])
    med = statistics.median
    return {
        "layout": {"model_id": SMOL.model_id, "num_layers": SMOL.num_layers,
                   "num_kv_heads": SMOL.num_kv_heads, "head_dim": SMOL.head_dim,
                   "dtype": SMOL.dtype, "block_size": BS, "block_bytes": SMOL.block_bytes},
        "tier_blocks": {"device": sizes.device, "host": sizes.host, "disk": sizes.disk},
        "prefix_tokens": prefix_tokens, "blocks": num_blocks, "bytes": nbytes, "reps": reps,
        "written_by_a": written, "promoted_blocks": promoted, "hiredis": HIREDIS_AVAILABLE,
        "floor.mget_gbps": round(med(floor), 3),
        "floor.mget_nonatomic_gbps": round(med(nonatomic), 3),
        "store.get_run_gbps": round(med(get_run), 3),
        "remote.fetch_gbps": round(med(opened), 3),
        "store.get_run_vs_floor": round(med(g / f for g, f in zip(get_run, best_floor)), 3),
        "remote.fetch_vs_floor": round(med(o / f for o, f in zip(opened, best_floor)), 3),
        "best.floor_gbps": round(max(best_floor), 3),
        "best.store.get_run_gbps": round(max(get_run), 3),
        "best.remote.fetch_gbps": round(max(opened), 3),
        "best.store.get_run_vs_floor": round(max(get_run) / max(best_floor), 3),
        "best.remote.fetch_vs_floor": round(max(opened) / max(best_floor), 3),
        "per_rep_ms": {k: [round(t * 1e3, 1) for t in v] for k, v in times.items()},
        "remote.fetch_ms": round(med(times["open"]) * 1e3, 1),
        "store.get_run_ms": round(med(times["get_run"]) * 1e3, 1),
        "engine.tick_after_ms": round(med(times["tick"]) * 1e3, 1),
        "floor.mget_ms": round(med(times["floor"]) * 1e3, 1),
    }


def _second_pass_ideal(reqs) -> float:
    """Hit rate of an infinite cache that saw ``reqs`` once (prompt + output - 1 each), on ``reqs``."""
    hit = total = 0
    for r in reqs:
        n = len(r.prompt) // 4
        total += n
        hit += (n - 1) // BS * BS
    return hit / total


def hit_rate(cluster: RedisCluster, groups: int, prompts: int, work: str) -> dict:
    reqs = gsp(num_groups=groups, prompts_per_group=prompts)
    per_req = max(len(r.prompt) + len(r.output) for r in reqs) // 4 // BS + 1
    sizes = TierSizes(device=len(reqs) * per_req, host=len(reqs) * per_req, disk=0)
    engines = []
    try:
        a_engine = Engine(os.path.join(work, "ha"), _config(cluster.nodes, os.path.join(work, "shm-ha"), sizes))
        engines.append(a_engine)
        a = a_engine.pool(TENANT.name, TINY)
        for r in reqs:
            _serve(a, r.prompt + r.output[:-4], None)
        assert a.cluster.drain(120.0), "engine A's write-behind did not drain"
        b_engine = Engine(os.path.join(work, "hb"), _config(cluster.nodes, os.path.join(work, "shm-hb"), sizes))
        engines.append(b_engine)
        b = b_engine.pool(TENANT.name, TINY)
        cached = total = 0
        for r in reqs:
            seq = b.open(r.prompt)
            cached += seq.cached_tokens
            total += len(r.prompt) // 4
            b.release(seq.id)
        a_stats, b_stats = a.cluster.stats(), b.cluster.stats()
    finally:
        for e in engines:
            e.close()
    ideal = _second_pass_ideal(reqs)
    return {
        "workload": {"name": "gsp", "num_groups": groups, "prompts_per_group": prompts,
                     "requests": len(reqs)},
        "remote.hit_rate": round(cached / total, 4),
        "remote.ideal_hit_rate": round(ideal, 4),
        "remote.hit_vs_ideal": round(cached / total / ideal, 4),
        "local.ideal_hit_rate": round(ideal_hit_rate(reqs, BS), 4),
        "a.dropped_blocks": a_stats.get("dropped_blocks"),
        "a.written_blocks": a_stats.get("written_blocks"),
        "b.remote_hit_blocks": b_stats.get("remote_hit_blocks"),
        "b.fetches": b_stats.get("fetches"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON object (the only output)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS,
                   help="the fetched prefix (a multiple of 16; smaller only for smoke tests)")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="prefixd-bench-cluster-", dir="/var/tmp")
    try:
        with RedisCluster(nodes=3, maxmemory="512mb") as cluster:
            load_before = os.getloadavg()[0]
            out = {"bench": "cluster", "nodes": 3, "timeout_ms": TIMEOUT_MS,
                   "fetch": fetch(cluster, args.reps, work, args.prefix_tokens),
                   "hit_rate": hit_rate(cluster, args.groups, args.prompts, work),
                   "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2 if not args.json else None))


if __name__ == "__main__":
    main()
