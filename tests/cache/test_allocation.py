"""Room for a request: the feasibility check before any eviction, and the one allocate path."""

import pytest

from prefixd.cache import OutOfBlocks
from prefixd.cache import events as ev
from prefixd.cache.node import DEVICE, HOST

from tests.cache.helpers import make_cache, toks, tree_state


def _cached(cache, tokens):
    """Open, commit and release ``tokens``: their full blocks stay cached, unlocked."""
    seq = cache.open(toks(*tokens))
    cache.commit(seq.id)
    cache.release(seq.id)
    return seq


def test_an_open_that_cannot_succeed_evicts_nothing():
    """Regression: ``open`` evicted (demoted to host) every evictable run before it found it
    could not get enough device blocks, and then raised OutOfBlocks anyway."""
    cache = make_cache((4, 8))
    _cached(cache, range(9))  # a cached run of 2 blocks, evictable
    held = cache.open(toks(*range(100, 105)))  # 2 private blocks
    cache.drain_events()
    before = tree_state(cache)
    with pytest.raises(OutOfBlocks, match=r"need 3 blocks, 2 can be freed"):
        cache.open(toks(*range(200, 212)))
    assert tree_state(cache) == before
    assert cache.stats.evicted_blocks == 0
    cache.release(held.id)
    cache.check_invariants()


def test_an_open_that_cannot_succeed_does_not_split_or_touch_its_match():
    """Regression: a refused open had split the run its prompt matched partly (a split no
    record explains: replay's tree would differ) and touched it (moved it up the LRU order)."""
    cache = make_cache((4, 8))
    _cached(cache, range(9))  # a cached run of 2 blocks
    held = cache.open(toks(*range(100, 105)))
    cache.drain_events()
    before = tree_state(cache)
    with pytest.raises(OutOfBlocks):
        cache.open(toks(0, 1, 2, 3, *range(300, 308)))  # shares the first block only
    assert tree_state(cache) == before
    cache.release(held.id)
    cache.check_invariants()


def test_an_extend_that_cannot_succeed_evicts_nothing():
    """Regression: ``extend`` evicted before it knew it could succeed, as ``open`` did."""
    cache = make_cache((4, 8))
    _cached(cache, range(5))  # one cached block
    seq = cache.open(toks(*range(100, 105)))  # 2 private blocks, 1 free
    cache.drain_events()
    before = tree_state(cache)
    with pytest.raises(OutOfBlocks, match=r"need 3 blocks, 2 can be freed"):
        cache.extend(seq.id, list(range(12)))
    assert tree_state(cache) == before
    cache.check_invariants()


def test_the_match_an_open_locks_is_not_counted_as_evictable():
    """The open's own matched run cannot make room for the rest of it: refused, unchanged."""
    cache = make_cache((4, 8))
    _cached(cache, range(9))  # 2 cached blocks, the only evictable ones
    held = cache.open(toks(*range(100, 105)))
    cache.drain_events()
    before = tree_state(cache)
    assert not cache.can_allocate(3, cache.tree.peek(cache.tree.root(b""), toks(*range(9)), 2))
    with pytest.raises(OutOfBlocks, match=r"need 1 blocks, 0 can be freed"):
        cache.open(toks(*range(9)))  # hits both blocks, needs 1 more
    assert tree_state(cache) == before
    cache.release(held.id)


def test_an_open_that_can_succeed_evicts_and_succeeds():
    cache = make_cache((4, 8))
    _cached(cache, range(9))
    held = cache.open(toks(*range(100, 105)))
    assert cache.can_allocate(2) and not cache.can_allocate(3)
    seq = cache.open(toks(*range(200, 206)))  # 2 blocks: the cached run is demoted to host
    assert seq.cached_tokens == 0 and cache.stats.evicted_blocks == 2
    assert cache.tree.num_blocks_in[DEVICE] == 0 and cache.tree.num_blocks_in[HOST] == 2
    cache.release(held.id)
    cache.release(seq.id)
    cache.check_invariants()


def test_room_counts_cascading_evictions_and_stops_at_locked_paths():
    """Evicting a leaf makes its parent evictable: the check counts the whole unlocked part
    of the device, but nothing on the path to a locked node."""
    cache = make_cache(8)
    _cached(cache, range(9))                   # A: 2 blocks
    _cached(cache, [*range(8), 50, 51, 52, 53, 54])  # B below A: 1 block
    _cached(cache, [*range(8), 60, 61, 62, 63, 64])  # C below A: 1 block
    assert cache.device.num_free == 4 and cache.allocation.available() == 8
    b = cache.open(toks(*range(8), 50, 51, 52, 53, 54))  # locks B, so A too; 1 new block
    assert cache.allocation.available() == 3 + 1  # 3 free + C
    assert cache.tree.pinned_device_blocks() == 3
    cache.release(b.id)
    assert cache.allocation.available() == 8
    cache.check_invariants()


def test_a_promotion_takes_device_slots_through_the_same_allocation():
    """Promotion evicts through the one allocate path, so its evictions are counted too."""
    cache = make_cache((2, 8))
    _cached(cache, range(5))  # 1 block
    _cached(cache, range(10, 15))  # 1 block; the device holds both
    _cached(cache, range(20, 25))  # evicts the first to host
    cache.drain_events()
    evicted = cache.stats.evicted_blocks
    seq = cache.open(toks(*range(5)))  # promotes it back, evicting one
    assert seq.cached_tokens == 4
    assert cache.stats.evicted_blocks > evicted
    moved = [e for e in cache.drain_events() if isinstance(e, ev.BlocksMoved) and e.tier == DEVICE]
    assert len(moved) == 1
    cache.release(seq.id)
    cache.check_invariants()


def test_a_recovered_release_is_an_event():
    """The engine releases a recovered sequence through the core, so it is logged like any other."""
    cache = make_cache(4)
    _cached(cache, range(5))
    node = next(iter(cache.tree.nodes()))
    cache.tree.lock(node)  # as recovery holds a recovered sequence
    cache.drain_events()
    cache.release_recovered(7, node)
    assert cache.drain_events() == [ev.SeqReleased(7)]
    assert node.lock_ref == 0
    cache.check_invariants()


def test_a_refused_grow_with_slots_to_spare_names_the_budget_not_a_negative_shortfall():
    """With budgets, a pool can have the slots a request needs (free or evictable) but no
    bytes to place them: the refusal says so and names the key to raise."""
    message = str(OutOfBlocks(4, 7))
    assert "[engine.budget] device" in message and "short" not in message
    assert "(1 short)" in str(OutOfBlocks(4, 3))
