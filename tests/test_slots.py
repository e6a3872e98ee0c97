import pytest

from prefixd.storage.slots import SlotAllocator


def test_allocate_hands_out_ascending_slots_on_a_fresh_allocator():
    alloc = SlotAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    alloc.check_invariants()


def test_freed_slots_are_reused_first_in_the_same_order():
    alloc = SlotAllocator(8)
    first = alloc.allocate(3)
    alloc.allocate(2)
    alloc.free(first)
    assert alloc.allocate(3) == first
    alloc.check_invariants()


def test_allocate_returns_none_and_takes_nothing_when_short():
    alloc = SlotAllocator(4)
    alloc.allocate(3)
    assert alloc.allocate(2) is None
    assert alloc.num_free == 1
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)


def test_deferred_slots_are_not_reused_until_reclaimed():
    alloc = SlotAllocator(2)
    slots = alloc.allocate(2)
    alloc.defer_free(slots)
    assert alloc.allocate(1) is None
    assert alloc.num_deferred == 2 and alloc.num_used == 0
    assert alloc.reclaim_deferred() == 2
    assert sorted(alloc.allocate(2)) == [0, 1]
    alloc.check_invariants()


def test_take_marks_specific_slots_used_and_rejects_taken_ones():
    alloc = SlotAllocator(5)
    alloc.take([1, 3])
    assert alloc.num_used == 2
    assert alloc.allocate(3) == [0, 2, 4]
    with pytest.raises(ValueError, match="not free"):
        alloc.take([1])
    with pytest.raises(ValueError, match="out of range"):
        alloc.take([9])


def test_check_invariants_catches_a_double_free():
    alloc = SlotAllocator(3)
    slots = alloc.allocate(1)
    alloc.free(slots)
    alloc.free(slots)
    with pytest.raises(AssertionError):
        alloc.check_invariants()


def test_take_refuses_a_slot_given_twice():
    """Recovery must not accept two runs claiming one slot."""
    alloc = SlotAllocator(4)
    with pytest.raises(ValueError, match="twice"):
        alloc.take([2, 2])
    assert alloc.num_free == 4
