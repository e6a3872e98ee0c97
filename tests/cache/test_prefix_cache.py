"""Unit tests of the cache core: exact block ids where order is the spec."""

import numpy as np
import pytest

from prefixd.cache import InvalidTokens, OutOfBlocks, UnknownSequence
from prefixd.cache import events as ev
from prefixd.cache.hashing import chain_hashes, namespace_hash
from prefixd.cache.invariants import block_ref_counts

from tests.cache.helpers import BS, TokenPool, make_cache, toks


def test_open_on_an_empty_cache_allocates_fresh_blocks_in_order():
    cache = make_cache()
    seq = cache.open(toks(*range(10)))
    assert seq.block_table == [0, 1, 2]
    assert seq.cached_tokens == 0 and len(seq) == 10
    cache.check_invariants()


def test_a_committed_prefix_is_shared_and_the_rest_is_fresh():
    cache = make_cache()
    a = cache.open(toks(*range(10)))
    cache.commit(a.id)
    b = cache.open(toks(*range(8), 50, 51, 52))
    assert b.cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2:] == [3]
    cache.check_invariants()


def test_a_fully_cached_prompt_still_leaves_its_last_token_to_compute():
    cache = make_cache()
    a = cache.open(toks(*range(8)))
    cache.commit(a.id)
    b = cache.open(toks(*range(8)))
    assert b.cached_tokens == 4, "the last block must be recomputed to get the logits"
    cache.check_invariants()


def test_equal_tokens_under_different_prefixes_never_share_a_block():
    """Regression: hashing a block without its parent would share KV across prefixes."""
    cache = make_cache()
    a = cache.open(toks(1, 2, 3, 4, 9, 9, 9, 9, 0))
    cache.commit(a.id)
    b = cache.open(toks(5, 6, 7, 8, 9, 9, 9, 9, 0))
    assert b.cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    cache.commit(b.id)
    stored = [e for e in cache.drain_events() if isinstance(e, ev.BlocksStored)]
    assert stored[0].hashes[1] != stored[1].hashes[1], "block 1 got one name under two prefixes"


def test_block_hashes_chain_on_the_parent_from_the_namespace_root():
    cache = make_cache(root_hash=b"r" * 16)
    a = cache.open(toks(*range(9)))
    cache.commit(a.id)
    stored = [e for e in cache.drain_events() if isinstance(e, ev.BlocksStored)][0]
    assert stored.parent_hash == namespace_hash(b"r" * 16, b"")
    assert stored.hashes == chain_hashes(stored.parent_hash, toks(*range(8)), BS * 4)


def test_block_hashes_are_xxh3_128_of_the_parent_hash_and_the_block_bytes():
    """The durable name of a block (the WAL and checkpoints speak of it) is pinned to its
    definition, whatever way ``chain_hashes`` cuts the blocks (a struct unpack, cached per
    length), for runs of every length and a trailing partial block."""
    import os

    import xxhash

    for num_blocks in (1, 2, 23, 300):
        tokens = os.urandom(num_blocks * 64)
        h, want = b"p" * 16, []
        for s in range(0, len(tokens), 64):
            h = xxhash.xxh3_128_digest(h + tokens[s:s + 64])
            want.append(h)
        assert chain_hashes(b"p" * 16, tokens, 64) == want
        assert chain_hashes(b"p" * 16, tokens, 64) == want  # the cached splitter, again
        assert chain_hashes(b"p" * 16, tokens + b"abcd", 64)[:-1] == want


def test_namespaces_never_share_blocks():
    cache = make_cache()
    a = cache.open(toks(*range(9)), extra=b"lora-1")
    cache.commit(a.id)
    assert cache.open(toks(*range(9)), extra=b"lora-2").cached_tokens == 0
    assert cache.open(toks(*range(9)), extra=b"lora-1").cached_tokens == 8
    cache.check_invariants()


def test_a_match_ending_inside_a_node_splits_it():
    cache = make_cache()
    a = cache.open(toks(*range(17)))
    cache.commit(a.id)
    b = cache.open(toks(*range(8), 99, 99, 99, 99, 1))
    assert b.cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    cache.check_invariants()
    assert cache.lookup(toks(*range(17))).cached_tokens == 16


def test_lru_evicts_the_least_recently_used_leaf_and_reuses_its_slots():
    cache = make_cache(num_blocks=6)
    seqs = []
    for first in (100, 200, 300):
        s = cache.open(toks(first, 1, 2, 3, 4))  # one full block + one partial
        cache.commit(s.id)
        seqs.append(s)
    for s in seqs:
        cache.release(s.id)
    # Now 3 cached blocks (slots of block 0 of each) and 3 free; touch 100's prefix again.
    cache.release(cache.open(toks(100, 1, 2, 3, 4)).id)
    cache.check_invariants()
    lru = seqs[1].block_table[0]   # 200's block is now least recently used
    assert cache.device.num_free == 3
    s = cache.open(toks(*range(500, 516)))  # 4 blocks: 3 free + 1 evicted
    assert lru in s.block_table
    assert cache.lookup(toks(200, 1, 2, 3, 4)).cached_tokens == 0
    assert cache.lookup(toks(300, 1, 2, 3, 4)).cached_tokens == 4
    assert cache.lookup(toks(100, 1, 2, 3, 4)).cached_tokens == 4
    cache.check_invariants()


def test_lfu_evicts_the_least_hit_leaf_first():
    cache = make_cache(num_blocks=4, policy="lfu")
    for first in (100, 200):
        s = cache.open(toks(first, 1, 2, 3, 4))
        cache.commit(s.id)
        cache.release(s.id)
    for _ in range(3):
        cache.release(cache.open(toks(100, 1, 2, 3, 4)).id)
    cache.release(cache.open(toks(200, 1, 2, 3, 4)).id)  # most recent, but fewer hits
    cache.open(toks(*range(500, 512)))
    assert cache.lookup(toks(200, 1, 2, 3, 4)).cached_tokens == 0
    assert cache.lookup(toks(100, 1, 2, 3, 4)).cached_tokens == 4
    cache.check_invariants()


def test_eviction_takes_children_before_parents():
    cache = make_cache(num_blocks=8)
    s = cache.open(toks(*range(9)))
    cache.commit(s.id)
    t = cache.open(toks(*range(8), 7, 7, 7, 7, 0))
    cache.commit(t.id)
    cache.release(s.id)
    cache.release(t.id)
    cache.check_invariants()
    assert cache.evict(1) == 1  # the leaf (block 2 of t), never the shared parent
    assert cache.lookup(toks(*range(9))).cached_tokens == 8
    assert cache.lookup(toks(*range(8), 7, 7, 7, 7, 0)).cached_tokens == 8
    cache.check_invariants()


def test_out_of_blocks_names_the_shortfall_and_changes_nothing():
    cache = make_cache(num_blocks=4)
    s = cache.open(toks(*range(12)))
    with pytest.raises(OutOfBlocks, match=r"need 2 blocks, 1 can be freed \(1 short\)") as info:
        cache.open(toks(*range(100, 108)))
    assert info.value.needed == 2
    assert cache.device.num_free == 1 and cache.num_sequences == 1
    with pytest.raises(OutOfBlocks):
        cache.extend(s.id, list(range(9)))
    assert len(s) == 12 and len(s.block_table) == 3
    cache.check_invariants()


def test_out_of_blocks_releases_the_lock_it_took_on_the_shared_prefix():
    cache = make_cache(num_blocks=3)
    a = cache.open(toks(*range(5)))
    cache.commit(a.id)
    with pytest.raises(OutOfBlocks):
        cache.open(toks(*range(4), *range(100, 112)))
    cache.check_invariants()


def test_fork_shares_every_block_and_copy_on_write_copies_only_the_partial_tail():
    pool = TokenPool(16, BS)
    cache = make_cache(16, data=pool)
    tokens = list(range(6))
    parent = cache.open(toks(*tokens))
    pool.write(parent.block_table, tokens, 0)
    kids = cache.fork(parent.id, 2)
    assert all(k.block_table == parent.block_table for k in kids)
    assert block_ref_counts(cache)[parent.block_table[1]] == 3
    cache.check_invariants()
    new = cache.extend(kids[0].id, [42])
    assert new == [] and kids[0].block_table[0] == parent.block_table[0]
    assert kids[0].block_table[1] != parent.block_table[1]
    pool.write(kids[0].block_table, tokens + [42], 6)
    pool.check(parent.block_table, tokens)
    pool.check(kids[0].block_table, tokens + [42])
    assert cache.stats.cow_blocks == 1
    cache.check_invariants()
    cache.extend(kids[1].id, [43])
    cache.extend(parent.id, [44])  # last holder: no copy needed
    assert cache.stats.cow_blocks == 2
    cache.check_invariants()


def test_release_frees_private_blocks_and_keeps_indexed_ones_cached():
    cache = make_cache(num_blocks=8)
    s = cache.open(toks(*range(10)))
    cache.commit(s.id)
    cache.release(s.id)
    assert cache.device.num_free == 6
    assert cache.lookup(toks(*range(10))).cached_tokens == 8
    with pytest.raises(UnknownSequence, match="unknown sequence"):
        cache.release(s.id)
    cache.check_invariants()


def test_release_with_commit_indexes_first():
    cache = make_cache()
    s = cache.open(toks(*range(9)))
    cache.release(s.id, commit=True)
    assert cache.lookup(toks(*range(9))).cached_tokens == 8


def test_a_block_indexed_twice_switches_the_table_and_frees_the_duplicate_at_release():
    cache = make_cache(num_blocks=8)
    a = cache.open(toks(*range(9)))
    b = cache.open(toks(*range(9)))
    assert not set(a.block_table) & set(b.block_table)
    cache.commit(a.id)
    old_b = list(b.block_table)
    cache.commit(b.id)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.dup_slots == old_b[:2]
    cache.check_invariants()
    cache.release(b.id)
    assert cache.device.num_free == 8 - 3
    cache.check_invariants()


def test_bad_tokens_are_refused_with_a_clear_error():
    cache = make_cache()
    for bad in ([], b"\x00\x01\x02", [-1], [2**31], np.zeros((2, 2), dtype=np.int32), [1.5]):
        with pytest.raises(InvalidTokens):
            cache.open(bad)
    s = cache.open([1, 2])
    with pytest.raises(InvalidTokens):
        cache.extend(s.id, [-5])
    assert len(s) == 2
    with pytest.raises(UnknownSequence):
        cache.extend(999, [1])
    with pytest.raises(ValueError):
        cache.fork(s.id, 0)
    cache.check_invariants()


def test_events_record_each_change_in_order():
    cache = make_cache()
    s = cache.open(toks(*range(5)))
    cache.extend(s.id, [7, 8, 9])
    cache.commit(s.id)
    kids = cache.fork(s.id, 1)
    cache.release(s.id)
    kinds = [type(e).__name__ for e in cache.drain_events()]
    assert kinds == ["SeqOpened", "SeqExtended", "BlocksStored", "SeqCommitted", "SeqCommitted",
                     "SeqForked", "SeqReleased"] or kinds == [
        "SeqOpened", "SeqExtended", "BlocksStored", "SeqCommitted", "SeqForked", "SeqReleased"]
    assert cache.drain_events() == []
    assert kids[0].id != s.id


def test_lookup_neither_pins_nor_touches():
    cache = make_cache(num_blocks=4)
    for first in (100, 200):
        s = cache.open(toks(first, 1, 2, 3, 4))
        cache.commit(s.id)
        cache.release(s.id)
    assert cache.lookup(toks(100, 1, 2, 3, 4)).cached_tokens == 4  # no touch: 100 stays LRU
    cache.open(toks(*range(500, 512)))
    assert cache.lookup(toks(100, 1, 2, 3, 4)).cached_tokens == 0
    cache.check_invariants()
