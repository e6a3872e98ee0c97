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
    assert alloc.release_all_deferred() == 2
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


class _StackModel:
    """The allocator as first written: every free slot in one list, the stack top last."""

    def __init__(self, n: int) -> None:
        self.n, self.free, self.deferred = n, list(range(n - 1, -1, -1)), []

    def allocate(self, k: int):
        if k > len(self.free):
            return None
        out = self.free[len(self.free) - k:][::-1]
        del self.free[len(self.free) - k:]
        return out

    def take(self, slots) -> None:
        self.free = [s for s in self.free if s not in set(slots)]


@pytest.mark.parametrize("seed", range(20))
def test_the_never_used_bound_hands_out_exactly_what_one_free_list_did(seed):
    """Guards the lazy never-used range against changing which slot comes next."""
    import random

    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    alloc, model = SlotAllocator(n), _StackModel(n)
    if rng.random() < 0.3:  # recovery first: take some slots on the fresh allocator
        taken = rng.sample(range(n), rng.randrange(0, n + 1))
        alloc.take(taken)
        model.take(taken)
    held: list[int] = []
    for _ in range(200):
        r = rng.random()
        if r < 0.45:
            k = rng.randrange(0, 6)
            got = alloc.allocate(k)
            assert got == model.allocate(k)
            held += got or []
        elif r < 0.75 and held:
            part = [held.pop(rng.randrange(len(held))) for _ in range(rng.randrange(1, len(held) + 1))]
            alloc.free(part)
            model.free.extend(reversed(part))
        elif r < 0.9 and held:
            part = [held.pop()]
            alloc.defer_free(part)
            model.deferred += part
        else:
            alloc.release_all_deferred()
            model.free.extend(reversed(model.deferred))
            model.deferred.clear()
        assert alloc.num_free == len(model.free)
        assert alloc.num_used == n - len(model.free) - len(model.deferred)
        assert alloc.used_slots() == set(range(n)) - set(model.free) - set(model.deferred)
        alloc.check_invariants()


def test_quarantine_batches_come_back_in_order_once_the_watermark_passes_their_mark():
    """Free before reuse by watermark: a sealed batch is allocatable only once ``upto``
    reaches its mark; the open (unsealed) batch never comes back by watermark."""
    alloc = SlotAllocator(6)
    slots = alloc.allocate(6)
    alloc.defer_free(slots[:2])
    alloc.seal_deferred(10)
    alloc.defer_free(slots[2:4])
    alloc.seal_deferred(20)
    alloc.defer_free(slots[4:])  # open batch: its records are not logged yet
    assert alloc.next_deferred_mark() == 10
    assert alloc.release_deferred(9) == 0 and alloc.num_free == 0
    assert alloc.release_deferred(15) == 2 and alloc.allocate(2) == slots[:2]
    assert alloc.release_deferred(10**9) == 2 and alloc.num_deferred == 2
    alloc.check_invariants()
    assert alloc.release_all_deferred() == 2 and alloc.num_free == 4
    alloc.check_invariants()
    with pytest.raises(ValueError, match="ascend"):
        alloc.defer_free([0])
        alloc.seal_deferred(30)
        alloc.defer_free([1])
        alloc.seal_deferred(29)
