"""Block bytes survive every movement path unchanged, whatever the slot pattern."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xxhash

from prefixd.storage import checksum, movement
from prefixd.api.tiers import Tier

from .conftest import BIG, SMALL, block_data, same_bytes


@pytest.mark.parametrize("layout", [SMALL, BIG], ids=["16KiB-fp16", "256KiB-bf16"])
def test_blocks_survive_device_host_disk_device(make_store, layout, monkeypatch):
    monkeypatch.setattr(movement, "CHUNK_BYTES", 3 * layout.block_bytes)  # several chunks per batch
    store = make_store(layout, device=16, host=16, disk=16)
    ids = list(range(100, 110))
    data = block_data(layout, ids)
    dev = [3, 4, 5, 9, 0, 15, 7, 8, 1, 2]
    store.write(Tier.DEVICE, dev, data)
    host = [15, 14, 2, 3, 4, 5, 11, 0, 6, 7]
    down = store.copy(Tier.DEVICE, dev, Tier.HOST, host)
    assert down.checksums == [checksum.checksum(bytes(b.view(torch.uint8).reshape(-1).numpy())) for b in data]
    disk = [0, 1, 2, 3, 12, 13, 4, 10, 9, 8]
    spill = store.copy(Tier.HOST, host, Tier.DISK, disk, durable=True)
    assert spill.checksums == down.checksums
    store.write(Tier.DEVICE, list(range(16)), block_data(layout, range(16)))  # scribble over device
    back = [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    up = store.copy(Tier.DISK, disk, Tier.DEVICE, back, verify=spill.checksums)
    assert up.ok == [True] * 10 and up.checksums == spill.checksums
    assert same_bytes(store.read(Tier.DEVICE, back), data)
    assert same_bytes(store.read(Tier.DISK, disk), data)
    store.check_invariants()


def test_shuffled_slots_match_a_reference_model(make_store, monkeypatch):
    monkeypatch.setattr(movement, "CHUNK_BYTES", 5 * SMALL.block_bytes)
    store = make_store(device=64, host=64, disk=64)
    rng = random.Random(7)
    model: dict[tuple[Tier, int], int] = {}
    dev = list(range(64))
    store.write(Tier.DEVICE, dev, block_data(SMALL, dev))
    model.update({(Tier.DEVICE, s): s for s in dev})
    sums = {}
    for step in range(12):
        src_t, dst_t = rng.choice([(Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK), (Tier.DISK, Tier.DEVICE),
                                   (Tier.HOST, Tier.DEVICE), (Tier.DEVICE, Tier.DISK), (Tier.DISK, Tier.HOST)])
        n = rng.randint(1, 40)
        src = rng.sample([s for (t, s) in model if t == src_t], min(n, sum(t == src_t for t, _ in model)))
        if not src:
            continue
        dst = rng.sample(range(64), len(src)) if step % 2 else sorted(rng.sample(range(64), len(src)))
        verify = [sums[s] for s in src] if src_t is Tier.DISK else None
        res = store.copy(src_t, src, dst_t, dst, verify=verify)
        if dst_t is Tier.DISK:
            sums.update(zip(dst, res.checksums))
        ids = [model[(src_t, s)] for s in src]
        model.update({(dst_t, d): i for d, i in zip(dst, ids)})
        assert same_bytes(store.read(dst_t, dst), block_data(SMALL, ids)), f"step {step}: {src_t.name}->{dst_t.name}"


@pytest.mark.parametrize("dst", [[4, 5, 6, 7], [9, 2, 14, 0], [7, 6, 5, 4]], ids=["run", "scattered", "descending"])
def test_inline_copy_gathers_into_any_destination(make_store, dst):
    """A small copy is gathered on the calling thread, straight into the destination when its
    slots are one ascending run: bytes and checksums must be those of a plain gather either way."""
    store = make_store(device=16, host=16)
    src = [11, 3, 8, 1]
    data = block_data(SMALL, src)
    store.write(Tier.DEVICE, src, data)
    res = store.copy(Tier.DEVICE, src, Tier.HOST, dst)
    raw = data.view(torch.uint8).reshape(len(src), -1).numpy()
    assert res.checksums == [xxhash.xxh3_64_intdigest(row) for row in raw]
    assert same_bytes(store.read(Tier.HOST, dst), data)
    assert store.checksum(Tier.HOST, dst) == res.checksums


def test_inline_copy_reads_an_overlapping_source_before_writing():
    """Gathering into a destination run that overlaps the source rows (one pool) must read
    every source row first, as the gather-then-scatter it replaced did; ``take(out=)`` onto an
    overlapping slice would otherwise read rows it already overwrote."""
    rows = np.arange(8 * 16, dtype=np.uint8).reshape(8, 16)
    want = rows.copy()
    want[[2, 3, 4]] = rows[[1, 2, 3]]
    movement._gather_inline(rows, [1, 2, 3], rows, [2, 3, 4])
    assert (rows == want).all()


def test_run_start_finds_one_ascending_run():
    assert movement.run_start([5, 6, 7]) == 5 and movement.run_start([0]) == 0
    assert movement.run_start([5, 7, 6, 8]) is None  # the ends agree, the order does not
    assert movement.run_start([7, 6, 5]) is None and movement.run_start([1, 3]) is None


def test_copy_refuses_a_destination_run_past_the_tier(make_store):
    store = make_store(device=8, host=8)
    with pytest.raises(ValueError, match=r"HOST slots must be in \[0, 8\), got 6\.\.8"):
        store.copy(Tier.DEVICE, [0, 1, 2], Tier.HOST, [6, 7, 8])
    with pytest.raises(ValueError, match=r"HOST slots must be in \[0, 8\), got -1\.\.1"):
        store.copy(Tier.DEVICE, [0, 1, 2], Tier.HOST, [-1, 0, 1])


def test_copy_run_copies_one_run_between_memory_tiers_and_declines_the_rest(make_store):
    """The write-through's fast path: one run of slots into one run, device <-> host; any other
    shape (scattered, descending, DISK on either side) is declined with nothing copied, for
    ``copy`` to move."""
    store = make_store(device=16, host=16, disk=16)
    data = block_data(SMALL, range(40, 44))
    store.write(Tier.DEVICE, [2, 3, 4, 5], data)
    before = store.read(Tier.HOST, list(range(16))).clone()
    for src, dst in ([[2, 3, 4, 5], [9, 2, 14, 0]], [[5, 4, 3, 2], [0, 1, 2, 3]], [[2, 3, 5, 4], [0, 1, 2, 3]]):
        assert store.copy_run(Tier.DEVICE, src, Tier.HOST, dst) is False
    assert store.copy_run(Tier.DEVICE, [2, 3], Tier.DISK, [0, 1]) is False
    assert store.copy_run(Tier.DISK, [0, 1], Tier.HOST, [0, 1]) is False
    assert same_bytes(store.read(Tier.HOST, list(range(16))), before)  # declined: nothing written
    assert store.copy_run(Tier.DEVICE, [2, 3, 4, 5], Tier.HOST, [10, 11, 12, 13]) is True
    assert same_bytes(store.read(Tier.HOST, [10, 11, 12, 13]), data)
    assert same_bytes(store.read(Tier.HOST, list(range(10))), before[:10])  # nothing outside the run
    assert store.copy_run(Tier.HOST, [10, 11], Tier.DEVICE, [14, 15]) is True
    assert same_bytes(store.read(Tier.DEVICE, [14, 15]), data[:2])


def test_copy_run_refuses_a_run_past_the_tier_or_unequal_lengths(make_store):
    store = make_store(device=8, host=8)
    with pytest.raises(ValueError, match=r"HOST slots must be in \[0, 8\), got 6\.\.8"):
        store.copy_run(Tier.DEVICE, [0, 1, 2], Tier.HOST, [6, 7, 8])
    with pytest.raises(ValueError, match=r"DEVICE slots must be in \[0, 8\), got -1\.\.0"):
        store.copy_run(Tier.DEVICE, [-1, 0], Tier.HOST, [0, 1])
    with pytest.raises(ValueError, match="as many destination slots"):
        store.copy_run(Tier.DEVICE, [0, 1, 2], Tier.HOST, [0, 1])


def test_copy_within_each_tier(make_store):
    store = make_store()
    data = block_data(SMALL, [1, 2])
    for tier in Tier:
        store.write(tier, [0, 5], data)
        store.copy_within(tier, [0, 5], [7, 3])
        assert same_bytes(store.read(tier, [7, 3]), data)
    with pytest.raises(ValueError, match="overlap"):
        store.copy_within(Tier.HOST, [1, 2], [2, 3])


def test_copy_async_gives_the_same_result(make_store):
    store = make_store()
    store.write(Tier.HOST, [0, 1, 2], block_data(SMALL, [4, 5, 6]))
    fut = store.copy_async(Tier.HOST, [0, 1, 2], Tier.DISK, [5, 6, 7], durable=True)
    res = fut.result(timeout=10)
    assert res.checksums == store.checksum(Tier.HOST, [0, 1, 2]) == store.checksum(Tier.DISK, [5, 6, 7])
    up = store.copy_async(Tier.DISK, [5, 6, 7], Tier.DEVICE, [0, 1, 2], verify=res.checksums).result(timeout=10)
    assert up.ok == [True, True, True]


def test_streaming_checksum_equals_one_shot_for_big_blocks(make_store):
    """Blocks over one L2 piece are hashed piece by piece while copied; the digest must not change."""
    assert BIG.block_bytes > movement.L2_PIECE_BYTES
    store = make_store(BIG, device=2, host=2, disk=2)
    data = block_data(BIG, [9, 10])
    store.write(Tier.DEVICE, [0, 1], data)
    res = store.copy(Tier.DEVICE, [1, 0], Tier.HOST, [0, 1])
    raw = data.view(torch.uint8).reshape(2, -1).numpy()
    assert res.checksums == [xxhash.xxh3_64_intdigest(raw[1]), xxhash.xxh3_64_intdigest(raw[0])]


def test_runs_coalesce_consecutive_slots():
    assert movement.runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert movement.runs([]) == []
    assert movement.runs([1, 2, 3, 4], 1, 3) == [(1, 2, 2)]


def test_bad_arguments_are_refused_with_a_reason(make_store):
    store = make_store(disk=0)
    assert store.tiers == (Tier.DEVICE, Tier.HOST)
    with pytest.raises(ValueError, match="DISK is absent"):
        store.allocator(Tier.DISK)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        store.copy(Tier.DEVICE, [8], Tier.HOST, [0])
    with pytest.raises(ValueError, match="as many"):
        store.copy(Tier.DEVICE, [1, 2], Tier.HOST, [0])
    with pytest.raises(ValueError, match="verify="):
        store.copy(Tier.DEVICE, [1], Tier.HOST, [0], verify=[0])
    with pytest.raises(ValueError, match="expects"):
        store.write(Tier.HOST, [0], torch.zeros(1, 3))
    assert store.copy(Tier.DEVICE, [], Tier.HOST, []).checksums == []


def test_allocators_match_pools_and_keep_invariants(make_store):
    store = make_store(device=4, host=6, disk=8)
    for tier, n in ((Tier.DEVICE, 4), (Tier.HOST, 6), (Tier.DISK, 8)):
        alloc = store.allocator(tier)
        assert alloc.num_slots == n
        got = alloc.allocate(3)
        alloc.defer_free(got[:1])
        alloc.free(got[1:])
    store.check_invariants()
