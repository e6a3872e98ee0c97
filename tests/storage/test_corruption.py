"""A corrupt or truncated disk block is reported bad and never reaches the destination.

Shaped like etcd's WAL crash tests: a table of corruption functions through one harness.
"""

from __future__ import annotations

import os

import pytest

from prefixd.storage.poolfile import DATA_OFFSET
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore

from .conftest import SMALL, block_data, same_bytes

BB = SMALL.block_bytes


def _flip_bit(path: str, slot: int) -> None:
    off = DATA_OFFSET + slot * BB + 1234
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0x10]))


def _zero_page(path: str, slot: int) -> None:
    with open(path, "r+b") as f:
        f.seek(DATA_OFFSET + slot * BB + 4096)
        f.write(bytes(4096))


def _truncate_inside(path: str, slot: int) -> None:
    os.truncate(path, DATA_OFFSET + slot * BB + BB // 2)


CORRUPTIONS = {"bit_flip": _flip_bit, "zeroed_4k_page": _zero_page, "truncated_file": _truncate_inside}


def _spill(store, disk_slots):
    data = block_data(SMALL, [10 + s for s in disk_slots])
    store.write(Tier.HOST, list(range(len(disk_slots))), data)
    res = store.copy(Tier.HOST, list(range(len(disk_slots))), Tier.DISK, disk_slots, durable=True)
    return data, res.checksums


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_corrupt_disk_block_is_reported_bad_and_not_copied(make_store, corrupt):
    store = make_store()
    slots = [2, 3, 4, 5]
    data, sums = _spill(store, slots)
    corrupt(store.pool(Tier.DISK).path, 4)  # truncation also loses slot 5
    bad = {4} if corrupt is not _truncate_inside else {4, 5}
    fill = block_data(SMALL, [900, 901, 902, 903])
    store.write(Tier.DEVICE, [0, 1, 2, 3], fill)
    res = store.copy(Tier.DISK, slots, Tier.DEVICE, [0, 1, 2, 3], verify=sums)
    assert res.ok == [s not in bad for s in slots]
    assert res.bad_positions == [i for i, s in enumerate(slots) if s in bad]
    got = store.read(Tier.DEVICE, [0, 1, 2, 3])
    for i, s in enumerate(slots):
        want = fill[i] if s in bad else data[i]  # a bad block's bytes never land in the destination
        assert same_bytes(got[i], want), f"slot {s}"
    assert store.verify(Tier.DISK, slots, sums) == res.ok


def test_truncated_file_is_re_extended_on_reopen_and_its_lost_blocks_fail(make_store, tmp_path):
    """Regression: a mapped, truncated pool file would SIGBUS the daemon; reopening must work."""
    store = make_store()
    data, sums = _spill(store, [0, 6, 7])
    path, ids = store.pool(Tier.DISK).path, store.file_ids
    store.close()
    os.truncate(path, DATA_OFFSET + 6 * BB)
    again = TierStore(SMALL, {Tier.DISK: 8}, state_dir=str(tmp_path / "state"), name="t",
                      file_ids={Tier.DISK: ids[Tier.DISK]})
    try:
        assert os.path.getsize(path) == DATA_OFFSET + 8 * BB
        res = again.copy(Tier.DISK, [0, 6, 7], Tier.DISK, [1, 2, 3], verify=sums)
        assert res.ok == [True, False, False]
        assert same_bytes(again.read(Tier.DISK, [1]), data[:1])
    finally:
        again.close()


def test_unverified_disk_read_still_returns_checksums_to_compare(make_store):
    store = make_store()
    _, sums = _spill(store, [1])
    _flip_bit(store.pool(Tier.DISK).path, 1)
    res = store.copy(Tier.DISK, [1], Tier.HOST, [0])
    assert res.ok is None and res.checksums != sums
