"""Pool files: allocation fails early with numbers, headers refuse strangers, reopening keeps bytes."""

from __future__ import annotations

import os
import struct
import subprocess
import uuid

import pytest
import torch

from prefixd.api.layout import KVLayout
from prefixd.storage import poolfile
from prefixd.storage.errors import HeaderMismatchError, SpaceError
from prefixd.storage.poolfile import PoolHeader
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore

from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.extent_slots import ExtentSlotAllocator
from prefixd.storage.extents import EXTENT_BYTES, SparsePoolFile
from prefixd.storage.pools import TensorPool
from tests.requires import missing
from tests.storage.proc_maps import need_populate, resident_bytes

from .conftest import SMALL, block_data, same_bytes


def test_reopen_keeps_bytes_in_every_tier(make_store, tmp_path):
    store = make_store()
    data = block_data(SMALL, [1, 2, 3])
    for tier in Tier:
        store.write(tier, [5, 6, 7], data)
    store.sync(Tier.DISK)
    ids = store.file_ids
    store.close()
    again = make_store(file_ids=ids)
    assert again.file_ids == ids
    for tier in Tier:
        assert same_bytes(again.read(tier, [5, 6, 7]), data), tier.name


def test_fresh_replaces_the_files(make_store):
    store = make_store()
    store.write(Tier.DISK, [0], block_data(SMALL, [1]))
    old = store.file_ids
    store.close()
    again = make_store(fresh=True)
    assert all(again.file_ids[t] != old[t] for t in Tier)
    assert not again.read(Tier.DISK, [0]).view(-1).view(torch.uint8).any()


def test_shm_pool_in_dev_shm_is_mappable_by_path(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    name = f"prefixd-test-{uuid.uuid4().hex[:8]}"
    store = TierStore(SMALL, {Tier.HOST: 4}, state_dir=str(tmp_path), name=name, use_cuda=False)
    try:
        store.write(Tier.HOST, [2], block_data(SMALL, [5]))
        desc = store.descriptor(Tier.HOST)
        with open(desc["path"], "rb") as f:
            f.seek(desc["offset"] + 2 * SMALL.block_bytes)
            raw = f.read(SMALL.block_bytes)
        assert raw == block_data(SMALL, [5]).view(-1).numpy().tobytes()
    finally:
        store.close()
        os.unlink(os.path.join("/dev/shm", f"{name}.host.pool"))


def test_a_pool_file_is_mapped_with_its_held_extents_populated(tmp_path):
    """Every page of a held extent is in the page tables before a slot in it is handed out:
    the serving path never pays a page fault for a block's first touch (prefixd.storage.pools
    NOTE); the hole is not (``MAP_POPULATE`` would allocate all of it). Fails without the
    populate on grow: a freshly grown extent has nothing resident until touched."""
    need_populate()
    path = str(tmp_path / "host.pool")
    pool = TensorPool(SMALL, int(Tier.HOST), 1024, path=path, fresh=True)  # 16 MiB, 8 extents
    try:
        alloc = ExtentSlotAllocator(pool.sparse, recovered=True)
        assert EXTENT_BYTES <= resident_bytes(path) < 2 * EXTENT_BYTES
        slots = alloc.allocate(300)  # 4.7 MiB: extents 0..2
        assert resident_bytes(path) >= 3 * EXTENT_BYTES
        assert resident_bytes(path) < 4 * EXTENT_BYTES
        assert os.stat(path).st_blocks * 512 == 3 * EXTENT_BYTES == pool.sparse.charged
        alloc.free(slots)
        assert os.stat(path).st_blocks * 512 <= 2 * EXTENT_BYTES  # one idle extent kept
    finally:
        pool.close()


def _header_of(layout: KVLayout, kind=Tier.DISK, n=8, file_id=b"\1" * 16) -> PoolHeader:
    return PoolHeader(int(kind), layout.block_bytes, n, file_id, layout.to_bytes())


@pytest.mark.parametrize("change, match", [
    (dict(layout=KVLayout("other-model", 2, 2, 64)), "layout"),
    (dict(kind=Tier.HOST), "tier kind"),
    (dict(n=9), "num_slots"),
    (dict(file_id=b"\2" * 16), "file id"),
])
def test_header_mismatch_is_refused_with_the_field_named(tmp_path, change, match):
    path = str(tmp_path / "p.pool")
    os.close(poolfile.create_pool_file(path, _header_of(SMALL)))
    want = _header_of(change.get("layout", SMALL), change.get("kind", Tier.DISK), change.get("n", 8),
                      change.get("file_id", b"\1" * 16))
    with pytest.raises(HeaderMismatchError, match=match) as err:
        poolfile.open_pool_file(path, want, expect_file_id=True)
    assert path in str(err.value)


def test_other_format_version_and_torn_header_are_refused(tmp_path):
    path = str(tmp_path / "p.pool")
    os.close(poolfile.create_pool_file(path, _header_of(SMALL)))
    with open(path, "r+b") as f:  # version 2, with a valid header hash: a newer daemon wrote it
        raw = bytearray(f.read(poolfile.HEADER_BYTES))
        raw[8:12] = struct.pack("<I", 2)
        f.seek(0)
        f.write(_reencode(raw))
    with pytest.raises(HeaderMismatchError, match="format version"):
        poolfile.open_pool_file(path, _header_of(SMALL), expect_file_id=False)
    with open(path, "r+b") as f:
        f.seek(30)
        f.write(b"\xff")
    with pytest.raises(HeaderMismatchError, match="checksum"):
        poolfile.open_pool_file(path, _header_of(SMALL), expect_file_id=False)
    with open(path, "r+b") as f:
        f.write(b"NOTAPOOL")
    with pytest.raises(HeaderMismatchError, match="not a prefixd pool file"):
        poolfile.open_pool_file(path, _header_of(SMALL), expect_file_id=False)


def _reencode(raw: bytearray) -> bytes:
    magic, version, kind, off, bb, n, fid, ln = poolfile._FIXED.unpack_from(raw)
    layout = bytes(raw[poolfile._FIXED.size:poolfile._FIXED.size + ln])
    return PoolHeader(kind, bb, n, fid, layout, version, off).encode()


def test_a_pool_larger_than_its_filesystem_opens_as_a_hole(tmp_path):
    """A sparse file costs its held extents, not its size: a pool ten times the free space
    opens, holding only its header's extent."""
    n = 10 * poolfile.free_bytes(str(tmp_path)) // SMALL.block_bytes
    store = TierStore(SMALL, {Tier.DISK: n}, state_dir=str(tmp_path), name="huge", use_cuda=False)
    try:
        path = store.pool(Tier.DISK).path
        assert os.stat(path).st_size == poolfile.DATA_OFFSET + n * SMALL.block_bytes
        assert os.stat(path).st_blocks * 512 <= EXTENT_BYTES + 16384
        assert store.held_bytes(Tier.DISK) == EXTENT_BYTES
    finally:
        store.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        missing("mounting a 1 MiB tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        missing(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_header_extent_too_big_for_a_tiny_tmpfs_fails_at_start(tiny_tmpfs, tmp_path):
    with pytest.raises(SpaceError, match="asked for") as err:
        TierStore(SMALL, {Tier.HOST: 128}, state_dir=str(tmp_path), shm_dir=tiny_tmpfs, name="x", use_cuda=False)
    assert err.value.free_bytes <= 1 << 20 < err.value.needed_bytes


def test_fallocate_failure_is_a_space_error_too(tiny_tmpfs, tmp_path, monkeypatch):
    """Even when statvfs looked fine (another writer raced us), ENOSPC is a SpaceError, not SIGBUS later."""
    monkeypatch.setattr(poolfile, "check_space", lambda *a: None)
    with pytest.raises(SpaceError, match="No space left") as err:
        TierStore(SMALL, {Tier.HOST: 128}, state_dir=str(tmp_path), shm_dir=tiny_tmpfs, name="x", use_cuda=False)
    assert err.value.needed_bytes == EXTENT_BYTES  # the header's extent, of a 2 MiB file
    assert not os.listdir(tiny_tmpfs)


def test_a_grow_a_full_tmpfs_refuses_is_no_room_not_a_sigbus(tiny_tmpfs, tmp_path):
    """64 KiB extents on a 1 MiB tmpfs: allocating past it returns None (a full tier) and counts
    a refusal; freed slots are punched and can be had again."""
    header = PoolHeader(int(Tier.HOST), SMALL.block_bytes, 256, poolfile.new_file_id(), SMALL.to_bytes())
    sparse = SparsePoolFile(os.path.join(tiny_tmpfs, "p.pool"), header, ledger=BudgetLedger("host", 1 << 40),
                            tenant="t", durable=False, fresh=True, extent_bytes=64 << 10)
    alloc = ExtentSlotAllocator(sparse, recovered=True, keep_idle=0)
    try:
        got = alloc.allocate(40)  # 640 KiB of a 4 MiB file
        assert got is not None and alloc.gate.grow_refusals == 0
        assert alloc.allocate(40) is None
        assert alloc.gate.grow_refusals == 1
        assert alloc.num_free < 256 - 40  # only what can be had, so the cache evicts for it
        alloc.free(got)
        assert sparse.charged == 64 << 10  # the header's extent is all that is left
        assert alloc.allocate(40) is not None
        alloc.check_invariants()
    finally:
        sparse.close()
