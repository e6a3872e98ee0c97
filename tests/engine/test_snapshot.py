"""Checkpoint dump and load: the same tree back, from whole values or from chunk lists."""

from __future__ import annotations

import pytest

from prefixd.engine import snapshot as ckpt
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
    meta, nodes, hashes = ckpt.load(fresh.tree, index, 16)
    assert _shape(fresh.tree) == _shape(cache.tree)
    assert fresh.tree.num_blocks_in == cache.tree.num_blocks_in
    assert hashes.tolist() == [h for n in nodes for h in n.hashes]
    assert meta["records_version"] == ckpt.RECORDS_VERSION


def test_chunks_of_unequal_size_are_refused():
    with pytest.raises(ValueError, match="differ in size"):
        ckpt._Slices([b"abcd", b"ab", b"abcd"])
