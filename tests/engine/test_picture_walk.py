"""A checkpoint's picture taken in slices (``prefixd.engine.picture_walk``) while the engine
serves between them: the checkpoint is the state when the walk finishes, and a restart from it
plus the log after it rebuilds the live state."""

from __future__ import annotations

import random

import pytest

from prefixd.cache.errors import OutOfBlocks
from prefixd.cache.node import DISK, HOST
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.engine import checkpoint as ckpt
from prefixd.engine.picture_walk import PictureWalk
from tests.cache.helpers import StoreTokens
from tests.engine.factory import cache_factory
from tests.engine.test_checkpointer import BS, LAYOUT, prompts, serve


@pytest.fixture
def make(tmp_path):
    with cache_factory(tmp_path, LAYOUT, (48, 48, 160), checkpoint_records=10**9) as make:
        yield make


def _runs(index: dict, block_bytes: int) -> list:
    """Every run a checkpoint's ``index`` holds, with every field it stores, in a canonical
    order (the picture may order siblings differently from a dump)."""
    fresh = PrefixCache((8, 12, 64), BS)
    ckpt.load(fresh.tree, {k: ckpt.whole(v) for k, v in index.items()}, block_bytes)
    return sorted(((n.parent.hashes[-1], n.tokens, n.hashes, n.slots[0] is not None,
                    n.slots[HOST], n.slots[DISK], n.checksums, n.last_access, n.hit_count,
                    n.priority) for n in fresh.tree.nodes()), key=repr)


def _survivors(dc) -> dict:
    """What a restart keeps of the live tree: runs on the host or the disk, by their ends."""
    return {(n.hashes[0], n.hashes[-1]): (n.tokens, n.slots[HOST], n.slots[DISK],
                                          n.checksums if n.slots[DISK] is not None else None)
            for n in dc.cache.tree.nodes() if n.slots[HOST] is not None or n.slots[DISK] is not None}


class _Churn:
    """Commits (new runs, evictions down the tiers), commits of a prefix (a match ending inside
    a run splits it), lookups, sequences held open and committed later (blocks another
    sequence indexed meanwhile), forks, releases: drawn from one seed."""

    def __init__(self, dc, seed: int) -> None:
        self.dc = dc
        self.rng = random.Random(seed)
        self.asked = prompts(seed, 80)
        self.held: list[int] = []  # committed, not released
        self.pending: list = []  # opened, written, not committed

    def step(self) -> None:
        dc, rng = self.dc, self.rng
        what = rng.randrange(9)
        prompt = rng.choice(self.asked)
        try:
            if what == 0 and self.held:
                dc.release(self.held.pop(rng.randrange(len(self.held))))
            elif what == 0 and self.pending:
                seq = self.pending.pop()
                dc.commit(seq.id).result()
                dc.release(seq.id)
            elif what == 1:
                dc.lookup(prompt)
            elif what == 2 and not self.held:
                seq = serve(dc, prompt, release=False)
                self.held += [seq.id] + [c.id for c in dc.fork(seq.id, 1)]
            elif what == 3 and len(self.pending) < 2:
                self.hold(prompt)
            elif what >= 6:
                serve(dc, prompt[:rng.randrange(2, len(prompt) + 1)])
            else:
                serve(dc, prompt, "power" if prompt[-1] % 3 == 0 else "crash")
        except OutOfBlocks:
            pass  # refused before it changed anything

    def hold(self, prompt) -> None:
        """Open ``prompt`` and write its blocks, committed later; another sequence indexes the
        same blocks first (the later commit finds them in the tree: a touch, no new run)."""
        dc = self.dc
        try:
            seq = dc.open(prompt)
            StoreTokens(dc.store, BS).write(seq.block_table, prompt, seq.cached_tokens)
            self.pending.append(seq)
            serve(dc, prompt)
        except OutOfBlocks:
            pass


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_picture_taken_in_slices_between_changes_is_the_state_when_it_finishes(make, seed):
    dc = make()
    churn = _Churn(dc, seed)
    for _ in range(150):
        churn.step()
    block_bytes = dc.cache.block_bytes
    for _ in range(3):  # a few checkpoints, each walked a few runs at a time
        for _ in range(2):  # committed while the walk goes on, after it recorded their runs
            churn.hold(churn.rng.choice(churn.asked))
        walk = dc.upkeep.begin_picture()
        slices = 0
        while not walk.step(most=2):
            for _ in range(churn.rng.randrange(4)):
                churn.step()
            slices += 1
        assert slices > 5
        picture = dc.upkeep.begin_checkpoint(walk)
        want_index, want_seqs = ckpt.dump_engine(dc.cache, dc._sessions, dc.recovered.values(),
                                                 dc.store.file_ids)
        index, seqs = picture.values()
        assert _runs(index, block_bytes) == _runs(want_index, block_bytes)
        assert seqs == want_seqs
        dc.upkeep.submit_checkpoint(picture, index, seqs).result()
        dc.upkeep.end_checkpoint(picture)
        for _ in range(40):  # the log after the checkpoint
            churn.step()
    dc.check_invariants()
    want = _survivors(dc)
    dc.close()
    dc = make()  # recovered from the last checkpoint and the log after it
    assert _survivors(dc) == want
    dc.check_invariants()


def test_one_walk_at_a_time_and_a_walk_finished_only_at_its_end(make):
    dc = make()
    for p in prompts(4, 30):
        serve(dc, p)
    walk = dc.upkeep.begin_picture()
    with pytest.raises(RuntimeError, match="already being taken"):
        PictureWalk(dc.cache.tree)
    assert not walk.step(most=1)
    with pytest.raises(RuntimeError, match="nodes left"):
        dc.upkeep.begin_checkpoint(walk)
    assert dc.cache.tree.changed is None  # a failed finish stops the marks
    dc.upkeep.begin_picture().close()  # and another walk may start


def _pictured_equals_dump(dc, walk) -> None:
    picture = dc.upkeep.begin_checkpoint(walk)
    want_index, want_seqs = ckpt.dump_engine(dc.cache, dc._sessions, dc.recovered.values(),
                                             dc.store.file_ids)
    index, seqs = picture.values()
    assert _runs(index, dc.cache.block_bytes) == _runs(want_index, dc.cache.block_bytes)
    assert seqs == want_seqs


def test_a_commit_that_finds_its_blocks_indexed_after_the_walk_recorded_them(make):
    """The commit touches the run another sequence indexed (no new run, no residency
    change): the touch alone must be marked."""
    dc = make()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    seq = dc.open(prompt)
    StoreTokens(dc.store, BS).write(seq.block_table, prompt, seq.cached_tokens)
    serve(dc, prompt)
    walk = dc.upkeep.begin_picture()
    walk.step(float("inf"))
    dc.commit(seq.id).result()
    _pictured_equals_dump(dc, walk)
