"""Checkpoint dump and load: the same tree back, from whole values or from chunk lists."""

from __future__ import annotations

import numpy as np
import pytest

from prefixd.engine import checkpoint as ckpt
from prefixd.cache.node import DISK, HOST
from prefixd.cache.prefix_cache import PrefixCache
from tests.cache.helpers import toks


def _chunked(value: bytes, size: int) -> list[memoryview]:
    view = memoryview(value)
    return [view[i:i + size] for i in range(0, max(len(value), 1), size)]


def _shape(tree) -> list:
    out = []
    for node in tree.nodes():
        out.append((node.parent.hashes[-1], node.tokens, node.hashes, node.num_blocks,
                    node.slots[HOST], node.slots[DISK], node.slots[0] is not None, node.checksums,
                    node.last_access, node.hit_count, node.priority, node.kids_in))
    return sorted(out, key=repr)


def _cache_with_runs() -> PrefixCache:
    cache = PrefixCache((24, 16, 64), 4)
    for first in range(6):
        seq = cache.open(toks(first, *range(1, 14)))
        cache.commit(seq.id)
        cache.release(seq.id)
    seq = cache.open(toks(0, *range(1, 6)))  # a match ending inside a run splits it
    cache.release(seq.id)
    cache.evict(12)  # device -> host
    cache.evict(8, HOST)  # host -> disk
    for i, node in enumerate(cache.tree.nodes()):  # no store here: checksums by hand
        if node.slots[DISK] is not None:
            node.checksums = [7 * i + k for k in range(node.num_blocks)]
    cache.check_invariants()
    assert all(cache.tree.num_blocks_in), cache.tree.num_blocks_in  # every tier holds blocks
    return cache


@pytest.mark.parametrize("chunk", [None, 48, 64, 4096])
def test_load_rebuilds_the_tree_from_whole_values_or_chunks(chunk):
    """Chunks of 48 bytes cut token runs (16 bytes a block) across chunk borders."""
    cache = _cache_with_runs()
    index, _ = ckpt.dump(cache, {}, [])
    if chunk is not None:
        index = {k: _chunked(v, chunk) for k, v in index.items()}
    fresh = PrefixCache((32, 16, 64), 4)
    meta, nodes, hash_lo, placed = ckpt.load(fresh.tree, index, 16)
    assert _shape(fresh.tree) == _shape(cache.tree)
    assert fresh.tree.num_blocks_in == cache.tree.num_blocks_in
    assert hash_lo.tolist() == [int.from_bytes(h[:8], "little") for n in nodes for h in n.hashes]
    assert meta["records_version"] == ckpt.RECORDS_VERSION
    slot_lists = [n.slots for n in fresh.tree.nodes()]
    for tier in (HOST, DISK):
        assert sorted(placed.used(slot_lists, tier).tolist()) == sorted(
            s for n in cache.tree.nodes() if n.slots[tier] is not None for s in n.slots[tier])


def test_chunks_of_unequal_size_are_refused():
    with pytest.raises(ValueError, match="differ in size"):
        ckpt._Slices([b"abcd", b"ab", b"abcd"])


def test_placed_slots_follow_the_tree_after_splits_drops_and_moves():
    """Recovery lists the tier slots of the final tree from the checkpoint's columns for lists
    the load placed: a split, a drop or a new copy after the load must show, or the allocator
    would hand out a slot the index holds (or keep one it freed)."""
    from prefixd.cache.node import split

    cache = _cache_with_runs()
    index, _ = ckpt.dump(cache, {}, [])
    fresh = PrefixCache((32, 16, 64), 4)
    loaded = ckpt.load(fresh.tree, {k: _chunked(v, 48) for k, v in index.items()}, 16)
    tree = fresh.tree
    on_disk = [n for n in loaded.nodes if n.slots[DISK] is not None]
    longest = max(on_disk, key=lambda n: n.num_blocks)
    assert longest.num_blocks > 1
    split(longest, 1, 16)  # both parts get new lists
    leaf = next(n for n in tree.nodes() if n.slots[DISK] is not None and not n.children
                and n.slots[HOST] is not None)
    tree.unplace(leaf, DISK)
    newcomer = next(n for n in tree.nodes() if n.slots[DISK] is None)
    tree.place(newcomer, DISK, list(range(60, 60 + newcomer.num_blocks)))
    slot_lists = [n.slots for n in tree.nodes()]
    for tier in (HOST, DISK):
        want = sorted(s for n in tree.nodes() if n.slots[tier] is not None for s in n.slots[tier])
        assert sorted(loaded.placed.used(slot_lists, tier).tolist()) == want


def test_loaded_runs_dump_the_same_bytes_packed_or_unpacked():
    """Loaded runs keep hashes and checksums packed (``PackedNode``) until read: a checkpoint
    of a tree nobody touched must write what it loaded, and reading every run must not
    change what a later checkpoint writes."""
    cache = _cache_with_runs()
    index, _ = ckpt.dump(cache, {}, [])
    fresh = PrefixCache((32, 16, 64), 4)
    ckpt.load(fresh.tree, {k: _chunked(v, 48) for k, v in index.items()}, 16)
    assert ckpt.dump(fresh, {}, [])[0] == index
    for node in fresh.tree.nodes():
        node.hashes, node.checksums  # noqa: B018 - unpacks them
    assert ckpt.dump(fresh, {}, [])[0] == index
    fresh.tree.rebuild_queues()
    fresh.tree.check_invariants()  # chained hashes, one checksum a block


def test_packed_node_reads_sets_and_splits_like_a_node():
    """A ``PackedNode`` must read as the lists a plain ``Node`` holds, give up its packed
    form once set (a stale packed value would come back), and split like any node."""
    from prefixd.cache.node import Node, split
    from prefixd.engine.packed_node import PackedNode, packed_checksums, packed_hashes, run_ends

    hashes = [bytes([i]) * 15 + b"\0" for i in range(1, 5)]  # a trailing zero byte survives
    sums = [1, 2 ** 64 - 1, 3, 4]
    root = Node(None, b"", b"", 0, [b"r" * 16], [[], [], []])
    packed = PackedNode(root, b"k" * 16, b"k" * 64, 4, b"".join(hashes),
                        np.asarray(sums, "<u8").tobytes(), [None, None, [7, 8, 9, 10]])
    root.children[packed.key] = packed
    assert run_ends(packed) == (hashes[0], hashes[-1]) and packed.last_hash == hashes[-1]
    assert packed_hashes(packed) == b"".join(hashes) and packed._packed_hashes is not None
    assert packed.hashes == hashes and packed.checksums == sums and packed._packed_hashes is None
    assert packed_checksums(packed) == np.asarray(sums, "<u8").tobytes()
    head = split(packed, 1, 16)
    assert head.hashes == hashes[:1] and packed.hashes == hashes[1:]
    assert head.checksums == sums[:1] and packed.checksums == sums[1:]
    other = PackedNode(root, b"j" * 16, b"j" * 16, 1, hashes[0], None, [None, None, None])
    other.hashes = [b"x" * 16]
    other.checksums = [5]
    assert other.hashes == [b"x" * 16] and other.checksums == [5] and other.last_hash == b"x" * 16
