"""Sparse pool files under the durable engine: the bytes the host and disk files take
(``st_blocks``, measured here with ``os.stat``, not read from the engine) grow as blocks are
committed, and shrink once evicted blocks' slots are released from the quarantine; a restart
recovers the bytes and punches what its index does not name."""

import os

import pytest

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import Tier
from prefixd.engine.durable import DurableCache
from prefixd.storage.extents import EXTENT_BYTES
from tests.cache.helpers import StoreTokens

BS = 4
WIDE = KVLayout("sparse-test", num_layers=1, num_kv_heads=1, head_dim=2048, dtype="float32",
                block_size=BS)  # 64 KiB blocks: 32 to an extent
SIZES = (64, 128, 512)  # 4, 8 and 32 MiB files
SLACK = 64 * 1024  # a filesystem's own metadata blocks count in st_blocks too


def taken(path: str) -> int:
    return os.stat(path).st_blocks * 512


def files(dc: DurableCache) -> dict[Tier, str]:
    return {t: dc.store.pool(t).path for t in (Tier.DEVICE, Tier.HOST, Tier.DISK)}


def open_cache(tmp_path) -> DurableCache:
    return DurableCache(str(tmp_path / "state"), WIDE, SIZES, shm_dir=str(tmp_path / "shm"),
                        spill_blocks=8, reclaim_grace_s=0.0)


def commit_prompts(dc: DurableCache, n: int, first: int = 0) -> list[list[int]]:
    pool, prompts = StoreTokens(dc.store, BS), []
    for i in range(first, first + n):
        tokens = [i * 100 + j for j in range(3 * BS)]  # three blocks each, nothing shared
        seq = dc.open(tokens)
        pool.write(seq.block_table, tokens, seq.cached_tokens)
        dc.commit(seq.id, "crash").result()
        dc.release(seq.id)
        prompts.append(tokens)
    dc.tick()
    dc.flush().result()
    return prompts


def evict_all(dc: DurableCache) -> None:
    for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
        dc.cache.evict(1 << 30, int(tier))
    dc.tick()  # logs the drops
    dc.flush().result()
    dc.tick()  # the quarantine releases what the durable drops freed


def test_the_files_grow_as_blocks_are_committed_and_shrink_when_evicted(tmp_path):
    dc = open_cache(tmp_path)
    try:
        paths = files(dc)
        start = {t: taken(p) for t, p in paths.items()}
        assert all(b <= EXTENT_BYTES + SLACK for b in start.values()), start
        commit_prompts(dc, 30)  # 90 blocks: 5.6 MiB
        grown = {t: taken(p) for t, p in paths.items()}
        for tier in (Tier.HOST, Tier.DISK):
            assert grown[tier] >= 3 * EXTENT_BYTES, (tier, grown)
            assert grown[tier] <= dc.store.held_bytes(tier) + SLACK
        evict_all(dc)
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):  # one idle extent is kept
            assert taken(paths[tier]) <= 2 * EXTENT_BYTES + SLACK, (tier, taken(paths[tier]))
            dc.store.shrink(tier)
            assert taken(paths[tier]) <= EXTENT_BYTES + SLACK, (tier, taken(paths[tier]))
            assert dc.store.held_bytes(tier) == EXTENT_BYTES
        dc.check_invariants()
        commit_prompts(dc, 30, first=100)  # the holes grow again, and serve
        assert taken(paths[Tier.DISK]) >= 3 * EXTENT_BYTES
        dc.check_invariants()
    finally:
        dc.close()


def test_a_restart_keeps_the_committed_bytes_and_punches_the_rest(tmp_path):
    dc = open_cache(tmp_path)
    try:
        prompts = commit_prompts(dc, 40)
        disk = dc.store.pool(Tier.DISK).path
        before = taken(disk)
    finally:
        dc.close()
    # a stray allocated extent the index knows nothing of (a crash between a free's commit
    # and its punch leaves one): recovery punches it
    with open(disk, "r+b") as f:
        os.posix_fallocate(f.fileno(), 10 * EXTENT_BYTES, EXTENT_BYTES)
    assert taken(disk) >= before + EXTENT_BYTES
    dc = open_cache(tmp_path)
    try:
        assert taken(disk) <= before + SLACK
        assert dc.store.held_bytes(Tier.DISK) >= before - SLACK
        for tokens in prompts:
            seq = dc.open(tokens)
            assert seq.cached_tokens == len(tokens) - BS  # an open computes its last block
            StoreTokens(dc.store, BS).check(seq.block_table, tokens[:seq.cached_tokens])
            dc.release(seq.id)
        dc.check_invariants()
    finally:
        dc.close()


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_the_extent_interface_names_the_slots_of_an_extent(tmp_path, tier):
    dc = open_cache(tmp_path)
    try:
        store = dc.store
        slots_per_extent = EXTENT_BYTES // WIDE.block_bytes
        assert store.extent_of(tier, 0) == 0
        assert store.extent_of(tier, slots_per_extent) == 1  # the header shifts slot 32 into extent 1
        for extent in range(3):
            for slot in store.extent_slots(tier, extent):
                assert extent in (store.extent_of(tier, slot), store.extent_of(tier, slot) + 1)
        with pytest.raises(ValueError):
            store.extent_of(tier, SIZES[tier])
        assert store.grow_refusals(tier) == 0
    finally:
        dc.close()
