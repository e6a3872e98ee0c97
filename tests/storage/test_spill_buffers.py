"""Staging buffers of the disk write-behind: reused across spills, never shared by two queued ones."""

import threading

import numpy as np

from prefixd.api.tiers import Tier
from prefixd.storage.pools import DiskPool
from prefixd.storage.spill_buffers import SpillBuffers
from tests.storage.conftest import block_data, same_bytes


def test_spills_reuse_one_staging_buffer_once_written(make_store):
    """Each write-behind spill gathered into a fresh ``numpy.take`` array (a page fault per
    page: the biggest single cost of a cluster promotion into full pools); once its write is
    done the next spill must gather into the same buffer."""
    store = make_store(device=8, host=8, disk=8)
    store.write_behind = True
    store.write(Tier.HOST, list(range(8)), block_data(store.layout, range(8)))
    for first in (0, 4, 0, 4):
        store.copy(Tier.HOST, list(range(first, first + 4)), Tier.DISK, list(range(first, first + 4)))
        store.sync(Tier.DISK)
    assert store._spill_buffers.num_allocated == 1
    assert same_bytes(store.read(Tier.DISK, range(8)), block_data(store.layout, range(8)))
    store.check_invariants()


def test_a_queued_spill_keeps_its_snapshot_while_the_next_one_gathers(make_store, monkeypatch):
    """A snapshot still queued for the writer must not be the buffer the next spill gathers
    into (a reused buffer handed out too early would write the second spill's bytes twice)."""
    store = make_store(device=8, host=8, disk=8)
    store.write_behind = True
    store.write(Tier.HOST, list(range(8)), block_data(store.layout, range(8)))
    gate, entered = threading.Event(), threading.Event()
    real = DiskPool.write_run

    def held(pool, *args):
        entered.set()
        gate.wait()
        return real(pool, *args)

    monkeypatch.setattr(DiskPool, "write_run", held)
    try:
        store.copy(Tier.HOST, [0, 1, 2, 3], Tier.DISK, [0, 1, 2, 3])
        assert entered.wait(10)
        store.copy(Tier.HOST, [4, 5, 6, 7], Tier.DISK, [4, 5, 6, 7])
    finally:
        gate.set()
    store.sync(Tier.DISK)
    assert same_bytes(store.read(Tier.DISK, range(8)), block_data(store.layout, range(8)))
    assert store._spill_buffers.num_allocated == 2
    store.check_invariants()


def test_a_spill_takes_the_smallest_idle_buffer_that_fits(make_store, monkeypatch):
    """With two idle buffers of different sizes, lending one raised ValueError out of every
    spill (``list.remove`` compared numpy arrays with ``==``): kill -9 workloads died at once."""
    store = make_store(device=8, host=8, disk=8)
    store.write_behind = True
    store.write(Tier.HOST, list(range(8)), block_data(store.layout, range(8)))
    gate, entered = threading.Event(), threading.Event()
    real = DiskPool.write_run

    def held(pool, *args):
        entered.set()
        gate.wait()
        return real(pool, *args)

    monkeypatch.setattr(DiskPool, "write_run", held)
    try:  # two buffers lent at once: 4 blocks and 3 blocks
        store.copy(Tier.HOST, [0, 1, 2, 3], Tier.DISK, [0, 1, 2, 3])
        assert entered.wait(10)
        store.copy(Tier.HOST, [4, 5, 6], Tier.DISK, [4, 5, 6])
    finally:
        gate.set()
    monkeypatch.setattr(DiskPool, "write_run", real)
    store.sync(Tier.DISK)
    store.copy(Tier.HOST, [7, 6], Tier.DISK, [7, 6])  # both idle: the 3-block one is lent
    store.sync(Tier.DISK)
    assert same_bytes(store.read(Tier.DISK, range(8)), block_data(store.layout, range(8)))
    assert store._spill_buffers.num_allocated == 2
    store.check_invariants()


def test_lending_picks_the_smallest_idle_buffer_that_fits_among_many():
    """The lend scan (a plain loop since ``min(key=shape[0])`` cost most of a spill's
    instructions) must still take the smallest fitting buffer, and allocate when none fits."""
    buffers = SpillBuffers(block_bytes=4)
    rows = np.arange(64, dtype=np.uint8).reshape(16, 4)
    lent = [buffers.take(rows, list(range(n))) for n in (8, 3, 5, 4, 6)]
    for snapshot in lent:
        buffers.give_back(snapshot)
    assert buffers.num_allocated == 5
    got = buffers.take(rows, [9, 2, 7, 1])
    assert got.base.shape[0] == 4 and got.tolist() == rows[[9, 2, 7, 1]].tolist()
    assert buffers.take(rows, [0, 1]).base.shape[0] == 3
    assert buffers.take(rows, list(range(7))).base.shape[0] == 8
    assert buffers.take(rows, list(range(9))).base.shape[0] == 9 and buffers.num_allocated == 6
    buffers.check_invariants()
