"""Factories for storage tests: small layouts, deterministic block bytes, temporary stores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore

SMALL = KVLayout("test-small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)  # 16 KiB
BIG = KVLayout("test-big", num_layers=10, num_kv_heads=4, head_dim=128, dtype="bfloat16", block_size=16)  # 320 KiB


def block_data(layout: KVLayout, block_ids) -> torch.Tensor:
    """Deterministic bytes for each block id: ``[n, *block_shape]`` of the layout's dtype."""
    block_ids = list(block_ids)
    if not block_ids:
        return torch.empty(layout.pool_shape(0), dtype=layout.torch_dtype())
    out = np.empty((len(block_ids), layout.block_bytes), dtype=np.uint8)
    for i, bid in enumerate(block_ids):
        seed = xxhash.xxh3_64_intdigest(f"{layout.model_id}/{bid}".encode())
        out[i] = np.random.default_rng(seed).integers(0, 256, layout.block_bytes, dtype=np.uint8)
    return torch.from_numpy(out).view(layout.torch_dtype()).view(layout.pool_shape(len(block_ids)))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN patterns in random fp16 bytes make ``torch.equal`` wrong)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def make_store(tmp_path):
    """``make_store(layout=SMALL, device=8, host=8, disk=8, **kw)``; closes every store at teardown."""
    made = []

    def make(layout=SMALL, device=8, host=8, disk=8, **kw):
        kw.setdefault("state_dir", str(tmp_path / "state"))
        kw.setdefault("shm_dir", str(tmp_path / "shm"))
        kw.setdefault("name", "t")
        kw.setdefault("use_cuda", False)
        store = TierStore(layout, {Tier.DEVICE: device, Tier.HOST: host, Tier.DISK: disk}, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
