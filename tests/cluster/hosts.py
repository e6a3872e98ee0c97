"""Engines standing for the hosts of a fleet, for the cluster tier's engine tests.

Each "host" is an ``Engine`` on its own state directory (so its own root seed: local block
hashes differ between hosts) with the same ``[engine.cluster]`` section. KV bytes are a
function of the whole prefix up to the block and of a label (``kv_of``), so a block served
from the wrong prompt, the wrong tenant's bytes or a damaged value is a wrong byte.
"""

from __future__ import annotations

import hashlib

import numpy as np

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import Tier
from prefixd.engine import Engine, EngineConfig, Tenant, TierSizes
from prefixd.config.cluster_settings import ClusterConfig

BS = 4
LAYOUT = KVLayout("cluster-tiny", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                  block_size=BS)
TENANTS = (Tenant("acme", "salt-acme"), Tenant("globex", "salt-globex"))


def config(tmp_path, nodes, **cluster) -> EngineConfig:
    cluster.setdefault("retry_after_s", 0.2)
    # a loaded 2-core test host stalls a thread for tens of ms: a timeout there would be a
    # miss these tests do not expect (timeouts are part A's store tests' business)
    cluster.setdefault("timeout_ms", 500)
    return EngineConfig(blocks=TierSizes(64, 128, 512), shm_dir=str(tmp_path / "shm"),
                        spill_blocks=8, tenants=TENANTS,
                        cluster=ClusterConfig(nodes=tuple(nodes), **cluster))


def kv_of(tokens: list[int], i: int, label: str = "acme") -> np.ndarray:
    """The KV bytes of block ``i`` of ``tokens`` (a function of the prefix up to it and ``label``)."""
    prefix = np.asarray(tokens[:(i + 1) * BS], np.int32).tobytes()
    seed = hashlib.blake2b(prefix + label.encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    return rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def serve(dc, tokens: list[int], label: str = "acme", durability: str = "crash") -> int:
    """Open, write the uncached blocks' KV, commit (waiting for the ticket), release; returns
    the cached tokens the open reported."""
    seq = dc.open(tokens)
    rows = dc.store.pool(Tier.DEVICE).raw.numpy()
    for i in range(seq.num_indexed, len(tokens) // BS):
        rows[seq.block_table[i]] = kv_of(tokens, i, label)
    dc.commit(seq.id, durability).result()
    dc.release(seq.id)
    return seq.cached_tokens


def served(dc, tokens: list[int], label: str = "acme") -> tuple[int, int]:
    """Open ``tokens`` and compare every cached block's bytes with ``kv_of``; release.
    Returns ``(cached_tokens, wrong_blocks)``."""
    seq = dc.open(tokens)
    rows = dc.store.pool(Tier.DEVICE).raw.numpy()
    wrong = sum(not np.array_equal(rows[seq.block_table[i]], kv_of(tokens, i, label))
                for i in range(seq.cached_tokens // BS))
    dc.release(seq.id)
    return seq.cached_tokens, wrong


def prompt(seed: int, num_blocks: int = 10) -> list[int]:
    """A prompt of ``num_blocks`` full blocks plus one token (all of them servable)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, num_blocks * BS + 1)]


def host(tmp_path, name: str, cfg: EngineConfig) -> Engine:
    return Engine(str(tmp_path / name), cfg)
