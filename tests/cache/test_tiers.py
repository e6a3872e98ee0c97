"""Residency across device, host and disk: demotion, write policies, promotion, corruption."""

import os

import pytest

from prefixd.cache import PrefixCache
from prefixd.cache.node import DISK, HOST
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore
from tests.cache.helpers import StoreTokens, tiny_layout, toks

BS = 2


@pytest.fixture
def tiered(tmp_path):
    """``tiered(device, host, disk, **cache_kw) -> (cache, tokens_pool, store)``."""
    made = []

    def make(device=4, host=4, disk=8, **kw):
        store = TierStore(tiny_layout(BS), {Tier.DEVICE: device, Tier.HOST: host, Tier.DISK: disk},
                          state_dir=str(tmp_path / "state"), shm_dir=str(tmp_path / "shm"),
                          name=f"c{len(made)}", fresh=True, use_cuda=False)
        made.append(store)
        cache = PrefixCache((device, host, disk), BS, data=store, **kw)
        return cache, StoreTokens(store, BS), store

    yield make
    for store in made:
        store.close()


def _commit(cache, pool, tokens):
    seq = cache.open(toks(*tokens))
    pool.write(seq.block_table, tokens, seq.cached_tokens)
    cache.commit(seq.id)
    cache.release(seq.id)
    cache.check_invariants()
    return seq


def test_write_through_puts_committed_blocks_in_every_tier(tiered):
    cache, pool, _ = tiered()
    _commit(cache, pool, [1, 2, 3, 4, 5])
    node = next(cache.tree.nodes())
    assert node.num_blocks == 2 and all(s is not None for s in node.slots)
    assert len(node.checksums) == 2
    assert cache.lookup(toks(1, 2, 3, 4, 5)).device_tokens == 4


def test_bytes_survive_device_to_host_to_disk_to_device(tiered):
    """write_back: evicting demotes, one tier at a time; a hit promotes the run back."""
    cache, pool, _ = tiered(device=4, host=2, disk=8, write_policy="write_back")
    tokens = [9, 8, 7, 6, 5]
    first = _commit(cache, pool, tokens)
    assert cache.evict(4) >= 2  # device -> host
    assert cache.lookup(toks(*tokens)).host_tokens == 4
    cache.check_invariants()
    assert cache.evict(2, HOST) == 2  # host -> disk
    assert cache.lookup(toks(*tokens)).disk_tokens == 4
    cache.check_invariants()
    seq = cache.open(toks(*tokens))
    assert seq.cached_tokens == 4
    assert cache.stats.hit_tokens_by_tier[DISK] == 4
    pool.check(seq.block_table[:2], tokens[:4])
    assert seq.block_table[:2] != [] and first.block_table  # promoted into device slots
    cache.check_invariants()


def test_device_eviction_keeps_the_run_in_a_lower_tier_and_a_hit_promotes_it(tiered):
    cache, pool, _ = tiered(device=4, host=4, disk=8)
    a = [1, 1, 1, 1, 0]
    _commit(cache, pool, a)
    _commit(cache, pool, [2, 2, 2, 2, 0])  # evicts a from device (LRU), a stays on host/disk
    assert cache.lookup(toks(*a)).device_tokens == 0
    assert cache.lookup(toks(*a)).host_tokens == 4
    seq = cache.open(toks(*a))
    assert seq.cached_tokens == 4 and cache.stats.hit_tokens_by_tier[HOST] == 4
    pool.check(seq.block_table, a[:4])
    cache.check_invariants()


def test_a_write_through_of_one_run_is_one_copy_run_and_its_host_bytes_serve(tiered, monkeypatch):
    """A commit's fresh device slots and fresh host slots are single runs: the write-through
    takes the store's ``copy_run`` (no ``copy``), and the host copy is the right bytes once the
    device copy is gone."""
    cache, pool, store = tiered(device=4, host=4, disk=8)
    seen = _count_copies(monkeypatch, store)
    tokens = [6, 2, 8, 3, 1]
    _commit(cache, pool, tokens)
    assert [s for s in seen if s[1] == HOST] == []
    node = next(cache.tree.nodes())
    assert node.slots[HOST] is not None
    assert cache.evict(4) >= 2 and node.slots[0] is None  # only host (and disk) copies are left
    seq = cache.open(toks(*tokens))
    assert seq.cached_tokens == 4 and cache.stats.hit_tokens_by_tier[HOST] == 4
    pool.check(seq.block_table[:2], tokens[:4])
    cache.check_invariants()


def test_eviction_order_is_lru_per_tier(tiered):
    cache, pool, _ = tiered(device=8, host=4, disk=8, write_policy="write_back")
    for first in (10, 20, 30):
        _commit(cache, pool, [first, 1, 0])
    cache.release(cache.open(toks(10, 1, 0)).id)  # 20 is now least recently used
    cache.evict(1)  # device -> host: 20's block
    assert cache.lookup(toks(20, 1, 0)).host_tokens == 2
    cache.evict(1)
    assert cache.lookup(toks(30, 1, 0)).host_tokens == 2
    assert cache.lookup(toks(10, 1, 0)).device_tokens == 2
    cache.evict(1, HOST)  # host -> disk takes the host LRU: 20 again
    assert cache.lookup(toks(20, 1, 0)).disk_tokens == 2
    assert cache.lookup(toks(30, 1, 0)).host_tokens == 2
    cache.check_invariants()


def test_selective_forgets_runs_with_too_few_hits(tiered):
    cache, pool, _ = tiered(device=4, host=4, disk=4, write_policy="selective", selective_hits=2)
    _commit(cache, pool, [1, 2, 3])
    _commit(cache, pool, [4, 5, 6])
    for _ in range(2):
        cache.release(cache.open(toks(4, 5, 6)).id)
    cache.evict(4)
    assert cache.lookup(toks(1, 2, 3)).cached_tokens == 0  # one hit: forgotten
    assert cache.lookup(toks(4, 5, 6)).host_tokens == 2    # hit twice: kept on host
    cache.check_invariants()


def test_evicting_from_disk_forgets(tiered):
    cache, pool, _ = tiered(device=4, host=2, disk=2, write_policy="write_back")
    _commit(cache, pool, [1, 2, 3])
    cache.evict(4)
    cache.evict(2, HOST)
    assert cache.lookup(toks(1, 2, 3)).disk_tokens == 2
    cache.evict(2, DISK)
    assert cache.lookup(toks(1, 2, 3)).cached_tokens == 0
    cache.check_invariants()


def _disk_file(store):
    return store.pool(Tier.DISK).path


@pytest.mark.parametrize("damage", ["flip", "zero", "truncate"])
def test_a_corrupt_disk_block_is_dropped_and_never_served(tiered, damage):
    cache, pool, store = tiered(device=4, host=4, disk=8, write_policy="write_back")
    tokens = [3, 1, 4, 1, 5, 9, 2]  # three full blocks
    _commit(cache, pool, tokens)
    other = [7, 7, 7]
    _commit(cache, pool, other)
    cache.evict(8)
    cache.evict(4, HOST)
    node = next(n for n in cache.tree.nodes() if n.tokens[:8] == toks(3, 1))
    slot = node.slots[DISK][1]  # the second block of the run
    pool_file = store.pool(Tier.DISK)
    offset = pool_file.offset(slot)
    with open(_disk_file(store), "r+b") as f:
        if damage == "flip":
            f.seek(offset + 5)
            byte = f.read(1)[0]
            f.seek(offset + 5)
            f.write(bytes([byte ^ 0x10]))
        elif damage == "zero":
            f.seek(offset)
            f.write(bytes(store.layout.block_bytes))
        else:
            os.truncate(_disk_file(store), offset + 4)
    seq = cache.open(toks(*tokens))
    assert seq.cached_tokens == 2, "only the block before the damaged one may be served"
    assert cache.stats.corrupt_blocks >= 1
    pool.check(seq.block_table[:1], tokens[:2])
    assert cache.lookup(toks(*tokens)).cached_tokens == 2
    cache.release(seq.id)
    cache.check_invariants()
    if damage != "truncate":
        other_seq = cache.open(toks(*other))
        assert other_seq.cached_tokens == 2  # the rest keeps serving
        pool.check(other_seq.block_table[:1], other[:2])


def test_a_run_is_hashed_when_it_first_goes_to_disk_not_on_its_way_to_host(tiered, monkeypatch):
    """Only disk blocks are ever checked against checksums: a host copy hashes nothing, and
    the disk write takes them (once), then a disk read checks the bytes against them."""
    cache, pool, store = tiered(device=4, host=4, disk=8, write_policy="write_back")
    seen = []
    real = store.copy

    def copy(src, src_slots, dst, dst_slots, **kw):
        result = real(src, src_slots, dst, dst_slots, **kw)
        seen.append((src, dst, result.checksums))
        return result

    def copy_run(src, src_slots, dst, dst_slots):
        done = store.copy_run(src, src_slots, dst, dst_slots)
        if done:
            seen.append((src, dst, None))  # one copyto: hashes nothing
        return done

    monkeypatch.setattr(store, "copy", copy)
    monkeypatch.setattr(cache.tiering, "_copy_run", copy_run)  # the tiering holds the store's method
    tokens = [3, 1, 4, 1, 5]
    _commit(cache, pool, tokens)
    node = next(cache.tree.nodes())
    assert cache.evict(4) >= 2  # device -> host
    assert node.slots[HOST] is not None and node.checksums is None
    assert seen[-1][:2] == (0, HOST) and seen[-1][2] is None
    host_move = [e for e in cache.drain_events() if type(e).__name__ == "BlocksMoved" and e.tier == HOST]
    assert host_move and host_move[-1].checksums == []  # the record carries none
    assert cache.evict(2, HOST) == 2  # host -> disk: hashed now
    assert node.slots[DISK] is not None and node.checksums == store.checksum(Tier.DISK, node.slots[DISK])
    assert seen[-1][:2] == (HOST, DISK) and seen[-1][2] == node.checksums
    seq = cache.open(toks(*tokens))  # disk -> device, checked against them
    assert seq.cached_tokens == 4
    pool.check(seq.block_table[:2], tokens[:4])
    cache.check_invariants()


def _count_copies(monkeypatch, store):
    seen = []
    real = store.copy

    def copy(src, src_slots, dst, dst_slots, **kw):
        seen.append((src, dst, len(list(dst_slots))))
        return real(src, src_slots, dst, dst_slots, **kw)

    monkeypatch.setattr(store, "copy", copy)
    return seen


def test_a_spill_writes_every_waiting_run_in_one_copy_per_source_tier(tiered, monkeypatch):
    cache, pool, store = tiered(device=16, host=16, disk=16)
    cache.tiering.defer_disk = True
    prompts = [[7, 1, 2, 3, 4], [7, 1, 2, 3, 4, 5, 6, 8, 9], [8, 8, 1, 1, 2]]  # the 2nd extends the 1st
    for tokens in prompts:
        _commit(cache, pool, tokens)
    assert cache.tiering.pending_disk_blocks > 0
    seen = _count_copies(monkeypatch, store)
    assert cache.tiering.spill() == 3
    assert [s for s in seen if s[1] == DISK] == [(0, DISK, 2 + 2 + 2)]  # one copy, every block
    for node in cache.tree.nodes():
        assert node.slots[DISK] is not None and node.checksums == store.checksum(Tier.DISK, node.slots[DISK])
    cache.check_invariants()
    assert cache.evict(16) and cache.evict(16, HOST)  # only the disk copies are left
    for tokens in prompts:
        seq = cache.open(toks(*tokens))
        assert seq.cached_tokens == len(tokens) // BS * BS
        pool.check(seq.block_table[:len(tokens) // BS], tokens[:len(tokens) // BS * BS])
        cache.release(seq.id)
    cache.check_invariants()


def test_a_spill_without_room_for_all_goes_one_run_at_a_time(tiered, monkeypatch):
    """3 runs of 2 blocks, 3 disk slots: no room for the batch, so each run is written alone
    (each evicting the last from disk, as a write-down does); the index stays whole."""
    cache, pool, store = tiered(device=16, host=16, disk=3)
    cache.tiering.defer_disk = True
    for tokens in ([1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [9, 9, 9, 9, 0]):
        _commit(cache, pool, tokens)
    seen = _count_copies(monkeypatch, store)
    assert cache.tiering.spill() == 3
    assert [s for s in seen if s[1] == DISK] == [(0, DISK, 2)] * 3
    on_disk = [n for n in cache.tree.nodes() if n.slots[DISK] is not None]
    assert len(on_disk) == 1 and on_disk[0].checksums == store.checksum(Tier.DISK, on_disk[0].slots[DISK])
    assert len(list(cache.tree.nodes())) == 3 and cache.tiering.pending_disk == []
    cache.check_invariants()
