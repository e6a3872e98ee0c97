"""write_kv / read_kv: a sequence's KV by token, into and out of its device blocks."""

import os

import pytest
import torch

from prefixd.api.layout import KVLayout
from prefixd.cache.errors import UnknownSequence
from prefixd.engine import DurableCache
from prefixd.engine.errors import SharedBlockError
from prefixd.engine.kv_io import MAX_RUNS

BS = 4
LAYOUT = KVLayout("kv-io", num_layers=2, num_kv_heads=2, head_dim=3, dtype="float32", block_size=BS)


@pytest.fixture
def dc(tmp_path):
    os.makedirs(tmp_path / "shm")
    cache = DurableCache(str(tmp_path / "state"), LAYOUT, (64, 64, 0), shm_dir=str(tmp_path / "shm"))
    yield cache
    cache.close()


def kv_for(first: int, n: int, seed: int = 0) -> torch.Tensor:
    """KV of tokens ``first .. first + n``: each value says which token, layer, K/V and lane it is."""
    pos = torch.arange(first, first + n, dtype=torch.float32).view(1, 1, n, 1, 1)
    layer = torch.arange(LAYOUT.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    kv = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1)
    lane = torch.arange(LAYOUT.num_kv_heads * LAYOUT.head_dim, dtype=torch.float32)
    lane = lane.view(1, 1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return seed * 1e6 + pos * 1000 + layer * 100 + kv * 10 + lane / 10


@pytest.mark.parametrize("start,n", [(0, 17), (0, 16), (3, 9), (5, 2), (4, 8), (7, 10), (17, 0)])
def test_kv_round_trips_across_block_boundaries_and_unaligned_starts(dc, start, n):
    seq = dc.open(list(range(100, 117)))  # 17 tokens: 4 full blocks and one partial
    dc.write_kv(seq, 0, kv_for(0, 17))
    dc.write_kv(seq, start, kv_for(start, n, seed=1))
    got = dc.read_kv(seq, 0, 17)
    want = kv_for(0, 17)
    want[:, :, start:start + n] = kv_for(start, n, seed=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the rows around the range are kept
    torch.testing.assert_close(dc.read_kv(seq.id, start, n), kv_for(start, n, seed=1), rtol=0, atol=0)


def test_kv_lands_in_the_pool_where_the_block_table_says(dc):
    seq = dc.open(list(range(10)))
    dc.write_kv(seq, 0, kv_for(0, 10))
    pool = dc.store.pool(0).tensor
    for t in range(10):
        block = pool[seq.block_table[t // BS]]
        torch.testing.assert_close(block[:, :, t % BS], kv_for(t, 1)[:, :, 0], rtol=0, atol=0)


def test_kv_round_trips_over_scattered_slots(dc):
    """Many runs of slots take the single indexed copy (``MAX_RUNS``)."""
    fillers = [dc.open(list(range(1000 * i, 1000 * i + BS))) for i in range(1, 2 * MAX_RUNS + 3)]
    for f in fillers[::2]:
        dc.release(f.id)  # every other slot comes free
    seq = dc.open(list(range(5000, 5000 + BS * (MAX_RUNS + 2))))
    table = seq.block_table
    assert sum(1 for a, b in zip(table, table[1:]) if b != a + 1) > MAX_RUNS, table
    n = len(seq)
    dc.write_kv(seq, 0, kv_for(0, n))
    torch.testing.assert_close(dc.read_kv(seq, 0, n), kv_for(0, n), rtol=0, atol=0)
    torch.testing.assert_close(dc.read_kv(seq, 2, n - 3), kv_for(2, n - 3), rtol=0, atol=0)


def test_writing_a_committed_block_is_refused_and_writes_nothing(dc):
    seq = dc.open(list(range(10)))
    dc.write_kv(seq, 0, kv_for(0, 10))
    dc.commit(seq.id, "index").result()
    before = dc.read_kv(seq, 0, 10)
    with pytest.raises(SharedBlockError, match=r"block 1, which is indexed.*tokens 8\.\.10 of it may be written"):
        dc.write_kv(seq, 6, kv_for(6, 4, seed=2))
    torch.testing.assert_close(dc.read_kv(seq, 0, 10), before, rtol=0, atol=0)
    dc.write_kv(seq, 8, kv_for(8, 2, seed=2))  # the partial last block is still its own


def test_a_cache_hit_cannot_be_overwritten(dc):
    first = dc.open(list(range(9)))
    dc.write_kv(first, 0, kv_for(0, 9))
    dc.release(first.id, commit=True, durability="index").result()
    seq = dc.open(list(range(9)) + [7])
    assert seq.cached_tokens == 8
    with pytest.raises(SharedBlockError):
        dc.write_kv(seq, 0, kv_for(0, 10, seed=3))
    dc.write_kv(seq, seq.cached_tokens, kv_for(8, 2, seed=3))


def test_a_tail_shared_with_forked_siblings_is_refused_until_extended(dc):
    seq = dc.open(list(range(6)))
    dc.write_kv(seq, 0, kv_for(0, 6))
    (child,) = dc.fork(seq.id, 1)
    with pytest.raises(SharedBlockError, match="forked siblings"):
        dc.write_kv(child, 5, kv_for(5, 1, seed=4))
    dc.extend(child.id, [42])  # copy-on-write: the tail is the child's own now
    dc.write_kv(child, 5, kv_for(5, 2, seed=4))
    torch.testing.assert_close(dc.read_kv(seq, 4, 2), kv_for(4, 2), rtol=0, atol=0)  # the parent's bytes


@pytest.mark.parametrize("start,n", [(0, 11), (10, 2), (11, 1), (-1, 1)])
def test_a_range_past_the_sequence_is_refused(dc, start, n):
    seq = dc.open(list(range(10)))
    with pytest.raises(ValueError, match="past the end|>= 0"):
        dc.read_kv(seq, start, n)
    with pytest.raises(ValueError, match="past the end|>= 0"):
        dc.write_kv(seq, start, kv_for(0, n) if n else kv_for(0, 0))


def test_kv_of_another_shape_or_dtype_is_refused(dc):
    seq = dc.open(list(range(10)))
    with pytest.raises(ValueError, match="shape"):
        dc.write_kv(seq, 0, kv_for(0, 4).transpose(0, 2))
    with pytest.raises(ValueError, match="dtype float32"):
        dc.write_kv(seq, 0, kv_for(0, 4).half())
    with pytest.raises(UnknownSequence):
        dc.read_kv(seq.id + 100, 0, 1)
