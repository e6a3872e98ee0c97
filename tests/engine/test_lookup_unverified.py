"""``lookup`` after a restart: disk blocks whose checksums were not checked are no sure hit."""

import os

import pytest

from prefixd.api.tiers import Tier
from prefixd.cache.node import DISK
from tests.engine.factory import cache_factory
from tests.cache.helpers import StoreTokens, tiny_layout

BS = 2
LAYOUT = tiny_layout(BS)
PROMPT = [1, 2, 3, 4, 5, 6, 7]  # three full blocks and a loose token


@pytest.fixture
def make(tmp_path):
    with cache_factory(tmp_path, LAYOUT, (8, 8, 32)) as make:
        yield make


def _restart_from_disk_with_block_damaged(make, tmp_path, bad_block: int | None):
    """Serve PROMPT at ``power``, lose the host pool (a reboot), damage one disk block."""
    dc = make()
    seq = dc.open(PROMPT)
    StoreTokens(dc.store, BS).write(seq.block_table, PROMPT, 0)
    dc.release(seq.id, commit=True, durability="power").result()
    slots = [s for n in dc.cache.tree.nodes() if n.slots[DISK] is not None for s in n.slots[DISK]]
    pool = dc.store.pool(Tier.DISK)
    dc.close()
    for name in os.listdir(tmp_path / "shm"):
        os.unlink(tmp_path / "shm" / name)
    if bad_block is not None:
        with open(pool.path, "r+b") as f:
            f.seek(pool.offset(slots[bad_block]))
            f.write(b"\xff" * 8)
    return make()


def test_lookup_does_not_promise_a_disk_block_that_turns_out_corrupt(make, tmp_path):
    """Regression: after a restart ``lookup`` counted disk blocks whose checksums no one had
    checked, so it promised tokens that ``open`` then found corrupt and did not serve."""
    dc = _restart_from_disk_with_block_damaged(make, tmp_path, bad_block=1)
    found = dc.lookup(PROMPT)
    assert found.cached_tokens == 0
    assert found.unverified_tokens == 6 and found.disk_tokens == 6
    seq = dc.open(PROMPT)
    assert seq.cached_tokens == 2  # the open checked them: the second block is corrupt
    assert seq.cached_tokens >= found.cached_tokens
    dc.release(seq.id)
    assert dc.lookup(PROMPT).cached_tokens == 2
    assert dc.lookup(PROMPT).unverified_tokens == 0
    dc.check_invariants()


def test_disk_blocks_count_as_cached_once_checked(make, tmp_path):
    dc = _restart_from_disk_with_block_damaged(make, tmp_path, bad_block=None)
    assert dc.lookup(PROMPT).cached_tokens == 0
    seq = dc.open(PROMPT)
    dc.release(seq.id)
    dc.cache.evict(8)  # back down to disk only: checked in this process, so still a sure hit
    found = dc.lookup(PROMPT)
    assert found.disk_tokens == 6 and found.cached_tokens == 6 and found.unverified_tokens == 0
    dc.check_invariants()


def test_eager_verify_makes_disk_blocks_sure_hits(make, tmp_path):
    dc = _restart_from_disk_with_block_damaged(make, tmp_path, bad_block=None)
    dc.close()
    dc = make(verify="eager")
    assert dc.lookup(PROMPT).cached_tokens == 6
    dc.check_invariants()


def test_blocks_this_process_wrote_to_disk_are_sure_hits(make):
    dc = make()
    seq = dc.open(PROMPT)
    StoreTokens(dc.store, BS).write(seq.block_table, PROMPT, 0)
    dc.release(seq.id, commit=True, durability="power").result()
    dc.cache.evict(8)
    dc.cache.evict(8, 1)
    found = dc.lookup(PROMPT)
    assert found.disk_tokens == 6 and found.cached_tokens == 6
    dc.check_invariants()
