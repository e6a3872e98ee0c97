"""A reclaim that finds no device room keeps the recovered sequence, and its lock, accounted for."""

import os

import pytest

from prefixd.cache import OutOfBlocks
from prefixd.engine import DurableCache
from tests.cache.helpers import tiny_layout

LAYOUT = tiny_layout(2)


def test_a_reclaim_refused_for_room_keeps_the_sequence_recovered(tmp_path):
    """Regression: ``reclaim`` popped the recovered sequence before its reopen raised
    OutOfBlocks, so its lock was never released (its blocks pinned for good) and it could be
    neither reclaimed again nor expired."""
    os.makedirs(tmp_path / "shm")
    kw = {"shm_dir": str(tmp_path / "shm"), "reclaim_grace_s": 3600}
    dc = DurableCache(str(tmp_path / "state"), LAYOUT, (4, 8, 32), **kw)
    seq = dc.open([1, 2, 3, 4, 5, 6, 7], session_id=3)  # 3 full blocks survive
    dc.commit(seq.id, "crash").result()
    dc.close()
    dc = DurableCache(str(tmp_path / "state"), LAYOUT, (4, 8, 32), **kw)
    try:
        assert list(dc.recovered) == [seq.id]
        hog = dc.open([9, 9, 9, 9, 9, 9, 9])  # holds all 4 device blocks
        with pytest.raises(OutOfBlocks):
            dc.reclaim(3)
        assert list(dc.recovered) == [seq.id], "the refused reclaim lost the sequence"
        dc.check_invariants()  # every lock has a holder
        dc.release(hog.id)
        got = dc.reclaim(3)
        assert [r.num_tokens for r in got] == [6] and not dc.recovered
        dc.release(got[0].seq.id)
        dc.check_invariants()
    finally:
        dc.close()
