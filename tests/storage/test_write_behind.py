"""Disk writes behind the caller: order, shared fdatasyncs, reads that never see old bytes."""

import threading

import pytest

from prefixd.api.tiers import Tier
from prefixd.storage.errors import StorageError
from prefixd.storage.pools import DiskPool
from prefixd.storage.write_behind import DiskWriter
from tests.storage.conftest import block_data, same_bytes


def test_a_copy_to_disk_returns_before_its_write_and_a_read_waits_for_it(make_store, monkeypatch):
    """Write-behind: the copy returns with the checksums while the pwritev is held; a read of
    the slot (or its checksum) then waits for the write and sees the new bytes, not the old."""
    store = make_store(device=4, host=4, disk=4)
    store.write_behind = True
    store.write(Tier.DEVICE, [0, 1], block_data(store.layout, [7, 8]))
    gate, entered = threading.Event(), threading.Event()
    real = DiskPool.write_run

    def held(pool, *args):
        entered.set()
        gate.wait()
        return real(pool, *args)

    monkeypatch.setattr(DiskPool, "write_run", held)
    try:
        result = store.copy(Tier.DEVICE, [0, 1], Tier.DISK, [2, 3])
        assert entered.wait(10)
        store.write(Tier.DEVICE, [0, 1], block_data(store.layout, [1, 2]))  # the source is reused at once
        got: list = []
        reader = threading.Thread(target=lambda: got.append(store.read(Tier.DISK, [2, 3])))
        reader.start()
        reader.join(0.2)
        assert not got, "a read of the disk pool did not wait for the queued write"
    finally:
        gate.set()
    reader.join(10)
    assert same_bytes(got[0], block_data(store.layout, [7, 8]))
    assert result.checksums == store.checksum(Tier.DISK, [2, 3])
    store.sync_async(Tier.DISK).result(timeout=10)


def test_waiters_share_one_fdatasync():
    """Syncs asked while an fdatasync is in flight are resolved by the next one, together."""
    started, gate = threading.Event(), threading.Event()
    calls = []

    def slow_sync():
        calls.append(1)
        started.set()
        gate.wait()

    writer = DiskWriter(slow_sync, "test")
    try:
        writer.submit(lambda: None, 1)
        first = writer.sync()
        assert started.wait(10)
        writer.submit(lambda: None, 1)
        later = [writer.sync() for _ in range(5)]
        gate.set()
        first.result(timeout=10)
        for fut in later:
            fut.result(timeout=10)
        assert len(calls) == 2
        writer.check_invariants()
    finally:
        gate.set()
        writer.close()


def test_a_failed_write_fails_every_later_sync_and_submit():
    """No retry over lost pages: after a failed write, syncs fail and nothing more is taken."""
    writer = DiskWriter(lambda: None, "test")
    try:
        def broken():
            raise OSError(5, "Input/output error")

        writer.submit(broken, 1)
        with pytest.raises(StorageError, match="Input/output error"):
            writer.sync().result(timeout=10)
        with pytest.raises(StorageError):
            writer.submit(lambda: None, 1)
    finally:
        writer.close()
