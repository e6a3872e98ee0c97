"""A several-pools workload for crash tests: two tenants x two KV layouts in one ``Engine``.

    python -m tests.crash.pools_workload STATE_DIR SHM_DIR ACK_LOG [--seed N] [--requests N]
        [--plant cross-pool|shared-bytes]

The child opens (recovering) an ``Engine`` on STATE_DIR with the four pools of ``POOLS``, then
serves random requests, each in one pool: a prompt of that pool alone (its first token is the
pool's marker, ``1000 + pool``) or a prompt from a space every pool draws from (first token
``SHARED``). KV is written as values derived from the token's whole prefix *and the pool*
(``PoolTokens``), so the same prompt holds different bytes in each pool. A commit is logged in
ACK_LOG (``pool tokens-hex``) only after it was acknowledged at ``crash`` durability.

``check(state_dir, shm_dir, acks)`` (used by the parent) reopens the engine and checks, pool by
pool: it lists exactly the four pools; every acknowledged prompt is a hit in its own pool with
that pool's bytes; no pool holds a block of another pool's own prompts (nor answers a lookup for
one); every block in its index, in every tier, holds its own pool's bytes; the block counts it
lists are the blocks its index holds; invariants hold.
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

from prefixd.api.layout import KVLayout
from prefixd.cache.node import path_to
from prefixd.engine import Engine, EngineConfig, Tenant, TierSizes
from tests.cache.helpers import StoreTokens
from tests.crash.prefixd_workload import verify_index

SHARED = 999  # first token of the prompts every pool draws from
TENANTS = (Tenant("acme", "salt-acme"), Tenant("globex", "salt-globex"))
LAYOUTS = (KVLayout("model-a", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=4),
           KVLayout("org/model-b", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=8))
POOLS = tuple((t.name, layout) for t in TENANTS for layout in LAYOUTS)


def make_config(shm_dir: str) -> EngineConfig:
    """Small device and host tiers (every run evicts and promotes); a disk big enough that
    nothing committed is ever forgotten, so every acknowledged prompt must stay a hit."""
    return EngineConfig(blocks=TierSizes(24, 48, 8192), checkpoint_records=200, spill_blocks=8,
                        reclaim_grace_s=0.0, shm_dir=shm_dir, tenants=TENANTS)


class PoolTokens(StoreTokens):
    """``StoreTokens`` whose values also depend on the pool: a block read from the wrong pool
    holds the wrong bytes."""

    def __init__(self, store, block_size: int, pool: int) -> None:
        super().__init__(store, block_size)
        self.pool = pool

    def values(self, tokens: list[int]) -> list[int]:
        return [(v + 7919 * (self.pool + 1)) % (1 << 20) for v in StoreTokens.values(tokens)]


def _commit(dc, seq_id: int) -> None:
    # NOTE: DurableCache.commit is becoming a ticket (a Future); wait for it either way.
    result = dc.commit(seq_id, "crash")
    if hasattr(result, "result"):
        result.result()


def run(args) -> None:
    from tests.crash.acklog import AckLog

    rng = random.Random(args.seed)
    engine = Engine(args.state_dir, make_config(args.shm_dir))
    pools = [engine.pool(tenant, layout) for tenant, layout in POOLS]
    for dc in pools:
        dc.expire_recovered()
    acks = AckLog(args.acks)
    systems = [[[1000 + i] + [rng.randrange(900) for _ in range(rng.choice((7, 11, 15)))]
                for _ in range(3)] for i in range(len(POOLS))]
    for n in range(args.requests):
        i = rng.randrange(len(POOLS))
        if rng.random() < 0.3:
            tokens = [SHARED] + [rng.randrange(3) for _ in range(rng.randint(4, 20))]
        else:
            tokens = rng.choice(systems[i]) + [rng.randrange(900) for _ in range(rng.randint(1, 12))]
        serve_in = i
        if args.plant == "cross-pool" and n % 3 == 2 and tokens[0] != SHARED:
            serve_in = (i + 1) % len(POOLS)  # planted bug: a request routed to the wrong pool
        dc = pools[serve_in]
        bs = dc.layout.block_size
        byte_pool = serve_in
        if args.plant == "shared-bytes" and tokens[0] == SHARED:
            byte_pool = 0  # planted bug: every pool serves pool 0's bytes for shared prompts
        seq = dc.open(tokens)
        PoolTokens(dc.store, bs, byte_pool).write(seq.block_table, tokens, seq.cached_tokens)
        _commit(dc, seq.id)
        full = len(tokens) // bs * bs
        if full:
            acks.ack(f"{i} {np.asarray(tokens[:full], '<i4').tobytes().hex()}")
        dc.release(seq.id)
        if n % 40 == 39:
            engine.tick()
    engine.close()


def check(state_dir: str, shm_dir: str, acks: list[str]) -> dict:
    """Reopen the engine and check every pool (see the module docstring); returns counts."""
    acked: list[list[list[int]]] = [[] for _ in POOLS]
    for line in acks:
        pool, hexed = line.split()
        acked[int(pool)].append(np.frombuffer(bytes.fromhex(hexed), "<i4").tolist())
    with Engine(state_dir, make_config(shm_dir)) as engine:
        engine.check_invariants()
        infos = engine.pools()
        assert [(p.tenant, p.layout) for p in infos] == sorted(
            POOLS, key=lambda p: (p[0], p[1].to_bytes())), f"pools listed: {infos}"
        by_key = {(p.tenant, p.layout): p for p in infos}
        counts = {"acks": 0, "blocks_verified": 0, "blocks": []}
        for i, (tenant, layout) in enumerate(POOLS):
            dc = engine.pool(tenant, layout)
            nodes = list(dc.cache.tree.nodes())
            per_tier = [sum(n.num_blocks for n in nodes if n.slots[t] is not None) for t in range(3)]
            assert list(by_key[(tenant, layout)].num_blocks) == per_tier, \
                f"pool {i} lists {by_key[(tenant, layout)].num_blocks} blocks, its index holds {per_tier}"
            counts["blocks"].append(per_tier)
            counts["blocks_verified"] += _verify_pool(dc, i, nodes)
            dc.expire_recovered()
            bs = layout.block_size
            distinct = set()
            for tokens in acked[i]:
                seq = dc.open(tokens + [0])
                assert seq.cached_tokens == len(tokens), (
                    f"pool {i}: acknowledged commit lost: {len(tokens)} tokens committed, "
                    f"{seq.cached_tokens} cached")
                PoolTokens(dc.store, bs, i).check(seq.block_table[: len(tokens) // bs], tokens)
                dc.release(seq.id)
                distinct.update(tuple(tokens[:k]) for k in range(bs, len(tokens) + 1, bs))
                counts["acks"] += 1
            assert sum(n.num_blocks for n in nodes) >= len(distinct), \
                f"pool {i} indexes fewer blocks than its acknowledged prompts fill"
            for j, others in enumerate(acked):
                for tokens in others if j != i else ():
                    if tokens[0] != SHARED:
                        got = dc.lookup(tokens + [0]).cached_tokens
                        assert got == 0, f"pool {i} hits {got} tokens of pool {j}'s prompt"
            dc.check_invariants()
    return counts


def _verify_pool(dc, pool: int, nodes) -> int:
    """Every indexed block of ``dc`` is one of its own prompts (or a shared one) and holds its
    own pool's bytes in every host and disk slot it has; returns the blocks checked."""
    for node in nodes:
        first = int(np.frombuffer(path_to(node)[0].tokens[:4], "<i4")[0])
        assert first in (SHARED, 1000 + pool), f"pool {pool} holds a block of pool {first - 1000}'s prompt"
    return verify_index(dc, PoolTokens(None, dc.layout.block_size, pool).values, f"pool {pool}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("state_dir")
    ap.add_argument("shm_dir")
    ap.add_argument("acks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=10**9)
    ap.add_argument("--plant", default="", choices=("", "cross-pool", "shared-bytes"),
                    help="a planted bug, to show that the check catches it")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
