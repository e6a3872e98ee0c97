"""``ExtentSlotAllocator``: slots handed out grow their extents first, freed ones give them
back, held extents are preferred, a refused grow is a full tier; checked against the file's
``st_blocks`` (``os.stat``) and the allocator's invariants after every step."""

import os
import random

import pytest

from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.extent_slots import ExtentSlotAllocator
from prefixd.storage.extents import SparsePoolFile
from prefixd.storage.poolfile import PoolHeader

EXTENT = 64 * 1024
SLACK = 16 * 1024  # a filesystem's own metadata blocks count in st_blocks too


def make(tmp_path, block_bytes, num_slots, budget=1 << 40, keep_idle=0):
    ledger = BudgetLedger("disk", budget)
    header = PoolHeader(2, block_bytes, num_slots, b"extent-slots-001", b"layout")
    sparse = SparsePoolFile(str(tmp_path / "p.pool"), header, ledger=ledger, tenant="t",
                            durable=False, fresh=True, extent_bytes=EXTENT)
    return ExtentSlotAllocator(sparse, recovered=True, keep_idle=keep_idle), ledger


def taken(alloc) -> int:
    return os.stat(alloc.file.path).st_blocks * 512


@pytest.mark.parametrize("block_bytes", [4096, 12 * 1024, EXTENT, 3 * EXTENT + 4096])
def test_random_allocate_free_quarantine_keeps_the_file_and_the_books_equal(tmp_path, block_bytes):
    rng = random.Random(block_bytes)
    num_slots = 8 * EXTENT // block_bytes + 3
    alloc, ledger = make(tmp_path, block_bytes, num_slots, keep_idle=rng.choice((0, 1)))
    used: list[int] = []
    mark = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            got = alloc.allocate(rng.randint(1, max(1, num_slots // 6)))
            if got is not None:
                assert not set(got) & set(used), "a slot handed out twice"
                used += got
        elif op < 0.7 and used:
            rng.shuffle(used)
            k = rng.randint(1, len(used))
            alloc.free(used[:k])
            del used[:k]
        elif op < 0.85 and used:
            k = rng.randint(1, len(used))
            alloc.defer_free(used[:k])
            del used[:k]
            mark += 1
            alloc.seal_deferred(mark)
        elif op < 0.95:
            alloc.release_deferred(rng.randint(0, mark))
        else:
            alloc.shrink()
        alloc.check_invariants()
        ledger.check_invariants()
        assert alloc.file.charged <= taken(alloc) <= alloc.file.charged + SLACK, step
        assert alloc.num_free + alloc.num_deferred + alloc.num_used == num_slots
    alloc.release_all_deferred()
    alloc.free(used)
    alloc.shrink()
    assert ledger.used_bytes == alloc.file.charged == EXTENT
    assert taken(alloc) <= EXTENT + SLACK


def test_free_slots_in_held_extents_come_first_lowest_extent_first(tmp_path):
    alloc, _ = make(tmp_path, 4096, 64)  # after the header's page: extent k is slots 16k-1 .. 16k+14
    assert alloc.allocate(60) == list(range(60))
    alloc.free(list(range(15, 31)))  # extent 1 whole: punched
    assert not alloc.file.extent_map.is_allocated(1)
    alloc.free([50, 40])  # extents 3 and 2, held
    assert alloc.allocate(1) == [40]  # not 15: its extent is a hole
    assert alloc.allocate(1) == [50]
    assert alloc.allocate(3) == [60, 61, 62]  # never-used slots of held extent 3 before the hole
    assert [alloc.extent_of(s) for s in alloc.allocate(1)] == [1]  # then the hole, grown
    assert alloc.file.extent_map.is_allocated(1)
    alloc.check_invariants()


def test_a_refused_grow_returns_none_and_only_held_slots_count_as_free(tmp_path):
    alloc, ledger = make(tmp_path, 4096, 64, budget=2 * EXTENT)  # the header's and one more
    first = alloc.allocate(31)  # extents 0 and 1: the budget's all
    assert first is not None and ledger.used_bytes == 2 * EXTENT
    assert alloc.allocate(1) is None
    assert alloc.gate.grow_refusals == 1
    assert alloc.num_free == 0  # nothing can be had until the cache evicts
    alloc.free(first[-3:])
    assert alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == sorted(first[-3:])
    alloc.free(first)
    assert alloc.num_free == 64 - 0 and alloc.allocate(40) is None  # past the budget
    assert alloc.gate.grow_refusals == 2


def test_the_first_take_is_the_files_recovery(tmp_path):
    alloc, ledger = make(tmp_path, 4096, 64)
    alloc.allocate(64)
    alloc.file.close()
    header = alloc.file.header
    sparse = SparsePoolFile(alloc.file.path, header, ledger=ledger, tenant="t", durable=False,
                            extent_bytes=EXTENT)
    again = ExtentSlotAllocator(sparse, keep_idle=0)
    assert taken(again) >= 4 * EXTENT  # nothing punched before recovery
    again.take([0, 1, 2])
    assert taken(again) <= EXTENT + SLACK  # slots 0..2 are in the header's extent
    assert sparse.charged == EXTENT == ledger.used_bytes
    assert again.num_used == 3 and again.allocate(1) == [3]
    again.check_invariants()


def test_extent_slots_are_the_slots_that_touch_it(tmp_path):
    alloc, _ = make(tmp_path, 12 * 1024, 40)
    em = alloc.file.extent_map
    for k in range(em.num_extents):
        want = [s for s in range(40) if k in em.touched([s])]
        assert list(alloc.extent_slots(k)) == want, k
    with pytest.raises(ValueError):
        alloc.extent_slots(em.num_extents)
    with pytest.raises(ValueError):
        alloc.free([40])


def test_freed_slots_come_back_as_ascending_runs(tmp_path):
    """A copy into one ascending run of slots is one slice (``movement.run_start``)."""
    alloc, _ = make(tmp_path, 4096, 64)
    first = alloc.allocate(10)
    assert first == list(range(10))
    alloc.free([7, 3, 5, 4, 6])
    assert alloc.allocate(5) == [3, 4, 5, 6, 7]
