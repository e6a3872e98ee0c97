"""Recovered sequences are released once their grace has passed, whether or not anyone ticks."""

import os
import time
import types

import pytest

from prefixd.engine import DurableCache
from prefixd.engine import durable
from tests.cache.helpers import tiny_layout

LAYOUT = tiny_layout(2)


@pytest.fixture
def restarted(tmp_path):
    """A cache restarted over one sequence that was live (session 3) when it went down."""
    os.makedirs(tmp_path / "shm")
    kw = {"shm_dir": str(tmp_path / "shm")}
    dc = DurableCache(str(tmp_path / "state"), LAYOUT, (8, 8, 32), **kw)
    seq = dc.open([1, 2, 3, 4, 5], session_id=3)
    dc.commit(seq.id, "crash").result()
    dc.close()
    dc = DurableCache(str(tmp_path / "state"), LAYOUT, (8, 8, 32), reclaim_grace_s=3600, **kw)
    assert dc.recovered
    yield dc
    dc.close()


def _an_hour_later(monkeypatch):
    real = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    clock = types.SimpleNamespace(**(real | {"monotonic": lambda: time.monotonic() + 7200}))
    monkeypatch.setattr(durable, "time", clock)


OPERATIONS = {
    "open": lambda dc, seq: dc.open([9, 9, 9]),
    "extend": lambda dc, seq: dc.extend(seq.id, [4]),
    "fork": lambda dc, seq: dc.fork(seq.id, 1),
    "commit": lambda dc, seq: dc.commit(seq.id, "index"),
    "release": lambda dc, seq: dc.release(seq.id),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_recovered_sequences_are_released_by_the_next_operation_after_the_grace(restarted, monkeypatch, operation):
    """Regression: recovered sequences kept their blocks pinned forever unless someone called
    ``tick()``; nothing in the engine did."""
    dc = restarted
    seq = dc.open([7, 7, 7, 7, 1])
    assert dc.recovered, "released before its grace"
    _an_hour_later(monkeypatch)
    OPERATIONS[operation](dc, seq)
    assert not dc.recovered
    dc.check_invariants()
    assert dc.lookup([1, 2, 3, 4, 5]).cached_tokens == 4  # the blocks stay cached


def test_recovered_sequences_stay_within_their_grace(restarted):
    dc = restarted
    seq = dc.open([7, 7, 7, 7, 1])
    dc.extend(seq.id, [2])
    dc.release(seq.id)
    dc.tick()
    assert [r.session_id for r in dc.recovered.values()] == [3]
    (got,) = dc.reclaim(3)
    assert got.num_tokens == 4
