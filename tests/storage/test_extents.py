"""Sparse pool files: extents grow before slots are handed out, are punched once every slot in
them is free, are charged to the tier's ledger as the filesystem counts them (``st_blocks``),
and survive reopening (``recover``); a punched block fails its checksum and is never served."""

import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

from prefixd.api.tiers import Tier
from prefixd.storage import poolfile
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import BudgetExceededError, HeaderMismatchError
from prefixd.storage.extent_map import ExtentMap
from prefixd.storage.extents import EXTENT_BYTES, SparsePoolFile
from prefixd.storage.poolfile import DATA_OFFSET, PoolHeader
from tests.storage.conftest import SMALL, block_data, same_bytes

KiB, MiB = 1 << 10, 1 << 20
EXT = 64 * KiB  # small extents keep the files small; the geometry is the same at 2 MiB


@pytest.fixture(params=["disk", "shm"])
def where(request, tmp_path):
    """A directory on the state directory's filesystem, or on /dev/shm (tmpfs)."""
    if request.param == "disk":
        yield str(tmp_path)
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="prefixd-extents-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def header(block_bytes=SMALL.block_bytes, num_slots=64, file_id=None, kind=int(Tier.DISK)):
    return PoolHeader(kind, block_bytes, num_slots, file_id or poolfile.new_file_id(),
                      SMALL.to_bytes())


def sparse(path, hdr=None, budget=16 * MiB, ledger=None, **kw):
    ledger = ledger or BudgetLedger("disk", budget)
    kw.setdefault("durable", True)
    kw.setdefault("extent_bytes", EXT)
    return SparsePoolFile(path, hdr or header(), ledger=ledger, tenant="t", **kw)


METADATA_SLACK = 16 * KiB


def check(pf):
    """Invariants, and the ledger's charge is what the filesystem says the file takes: exactly
    on tmpfs; on ext4 (the state directory) plus the extent tree's own blocks, which count in
    ``st_blocks`` too (one 4 KiB block per ~340 extents)."""
    pf.check_invariants()
    pf.ledger.check_invariants()
    held = pf.held_bytes()
    assert pf.ledger.used_by("t") == pf.charged
    if pf.path.startswith("/dev/shm/"):
        assert held == pf.charged, (held, pf.charged)
    else:
        assert pf.charged <= held <= pf.charged + METADATA_SLACK, (held, pf.charged)


def write_slots(pf, slots, seed=0):
    """Distinct bytes in each slot through ``pwrite``; returns them by slot."""
    rng = np.random.default_rng(seed)
    bb = pf.header.block_bytes
    data = {s: rng.integers(0, 256, bb, dtype=np.uint8).tobytes() for s in slots}
    for s, b in data.items():
        assert os.pwrite(pf.fd, b, DATA_OFFSET + s * bb) == bb
    return data


def read_slot(pf, s):
    bb = pf.header.block_bytes
    return os.pread(pf.fd, bb, DATA_OFFSET + s * bb)


def test_a_fresh_file_is_full_size_and_holds_only_its_header_extent(where):
    pf = sparse(os.path.join(where, "p.pool"))
    assert os.fstat(pf.fd).st_size == DATA_OFFSET + 64 * SMALL.block_bytes
    assert pf.charged == EXT
    check(pf)
    assert PoolHeader.decode(os.pread(pf.fd, 4096, 0), pf.path).num_slots == 64


def test_taking_slots_grows_their_extents_first_and_only_those(where):
    pf = sparse(os.path.join(where, "p.pool"))
    em = pf.extent_map                     # 16 KiB blocks, 64 KiB extents: slot 3 spans 0..1
    assert em.extents_of([3]) == [0, 1] and em.extents_of([0, 1, 2]) == [0]
    assert pf.take([0, 1, 2])
    check(pf)
    assert pf.charged == EXT
    assert pf.take([3, 20])
    check(pf)
    assert em.allocated_extents() == [0, 1, 5] and pf.charged == 3 * EXT
    before = pf.held_bytes()
    write_slots(pf, [0, 1, 2, 3, 20])      # writes into grown extents take no new blocks
    assert pf.held_bytes() == before
    check(pf)


def test_an_idle_extent_is_punched_and_its_neighbours_keep_their_bytes(where):
    """Planted bug this catches: ``ExtentMap.idle`` ignoring the user counts offers extents
    that still hold blocks in use; the check before the punch refuses them (ValueError), and
    without it the neighbours' bytes read back as zeros."""
    pf = sparse(os.path.join(where, "p.pool"))
    slots = list(range(0, 16))   # slot s: 4 KiB + s * 16 KiB; extent 1 holds slots 3..7,
    assert pf.take(slots)        # extent 2 slots 7..11, extent 3 slots 11..15
    data = write_slots(pf, slots)
    pf.give_back(range(4, 11))
    check(pf)
    assert pf.shrink() == 0      # slot 3 holds extent 1, slot 11 extent 2
    pf.give_back([11])
    assert pf.shrink() == EXT
    check(pf)
    assert pf.extent_map.allocated_extents()[:4] == [0, 1, 3, 4]
    for s in (0, 1, 2, 3, 12, 13, 14, 15):
        assert read_slot(pf, s) == data[s]
    assert read_slot(pf, 8) == bytes(SMALL.block_bytes)    # a hole reads as zeros


def test_shrink_keeps_the_lowest_idle_extents_when_asked(where):
    pf = sparse(os.path.join(where, "p.pool"))
    assert pf.take(range(40))
    pf.give_back(range(4, 40))
    idle = pf.extent_map.idle()
    assert idle == [2, 3, 4, 5, 6, 7, 8, 9, 10]     # slot 3 reaches into extent 1
    assert pf.shrink(keep_idle=2) == 7 * EXT
    assert pf.extent_map.idle() == [2, 3]
    check(pf)


def test_a_grow_the_budget_cannot_hold_takes_nothing_and_says_no_room(where):
    led = BudgetLedger("disk", 3 * EXT)
    pf = sparse(os.path.join(where, "p.pool"), ledger=led)
    assert pf.take([8])                     # extent 2: header + 1 extent
    assert not pf.take([12, 16])            # extents 3 and 4: one too many
    check(pf)
    assert pf.charged == 2 * EXT and [pf.extent_map.users_of(k) for k in (3, 4)] == [0, 0]
    assert pf.take([12])
    check(pf)


def test_a_header_extent_the_budget_cannot_hold_refuses_the_file(tmp_path):
    led = BudgetLedger("disk", EXT - 1)
    with pytest.raises(BudgetExceededError):
        sparse(str(tmp_path / "p.pool"), ledger=led)
    assert not (tmp_path / "p.pool").exists() and led.used_bytes == 0


@pytest.mark.parametrize("block_bytes", [12345, 100 * KiB, 3 * EXT + 512])
def test_odd_and_large_blocks_hold_every_extent_they_touch(where, block_bytes):
    pf = sparse(os.path.join(where, "p.pool"), header(block_bytes=block_bytes, num_slots=24),
                budget=64 * MiB)
    em = pf.extent_map
    assert pf.take([5, 6, 17])
    check(pf)
    for s in (5, 6, 17):
        first = (DATA_OFFSET + s * block_bytes) // EXT
        last = (DATA_OFFSET + (s + 1) * block_bytes - 1) // EXT
        assert all(em.is_allocated(k) and em.users_of(k) > 0 for k in range(first, last + 1))
    data = write_slots(pf, [5, 6, 17])
    pf.give_back([6])
    pf.shrink()
    check(pf)
    assert read_slot(pf, 5) == data[5] and read_slot(pf, 17) == data[17]
    pf.give_back([5, 17])
    pf.shrink()
    check(pf)
    assert pf.charged == EXT


def test_a_reopened_file_recovers_exactly_the_extents_its_index_names(where):
    """A crash leaves a grown extent nobody used and a freed extent not yet punched; recovery
    holds what the index names, punches the rest, and charges what the file then takes."""
    path = os.path.join(where, "p.pool")
    pf = sparse(path)
    assert pf.take(range(0, 30))
    data = write_slots(pf, range(0, 30))
    pf.close()
    assert pf.ledger.used_bytes == 0 and pf.charged == 0
    led = BudgetLedger("disk", 16 * MiB)
    again = sparse(path, pf.header, ledger=led, expect_file_id=True)
    assert again.charged == EXT
    kept = [0, 1, 2, 9, 10]                 # extents 0, 2 (9 = 148..164 KiB, 10 up to 180)
    again.recover(kept)
    check(again)
    assert again.extent_map.allocated_extents() == [0, 2]
    assert 2 * EXT <= again.held_bytes() <= 2 * EXT + METADATA_SLACK
    for s in kept:
        assert read_slot(again, s) == data[s]
    with pytest.raises(ValueError, match="right after opening"):
        again.recover(kept)


def test_a_recovery_that_does_not_fit_the_budget_is_refused_charging_nothing(tmp_path):
    path = str(tmp_path / "p.pool")
    pf = sparse(path)
    assert pf.take(range(60))
    pf.close()
    led = BudgetLedger("disk", 3 * EXT)
    again = sparse(path, pf.header, ledger=led)
    with pytest.raises(BudgetExceededError, match="recovered blocks need"):
        again.recover(range(60))
    assert led.used_bytes == EXT and again.extent_map.bytes_for(range(7)) == 2 * EXT
    assert again.extent_map.bytes_for(range(8)) == 3 * EXT      # slot 7 reaches extent 2


def test_another_pools_file_is_refused(tmp_path):
    path = str(tmp_path / "p.pool")
    sparse(path).close()
    led = BudgetLedger("disk", MiB)
    with pytest.raises(HeaderMismatchError, match="num_slots"):
        sparse(path, header(num_slots=65), ledger=led)
    assert led.used_bytes == 0


def test_unlink_closes_removes_and_releases_the_charge(tmp_path):
    pf = sparse(str(tmp_path / "p.pool"))
    assert pf.take([40])
    pf.unlink()
    pf.unlink()
    assert not os.path.exists(pf.path) and pf.ledger.used_bytes == 0


def test_slots_out_of_range_and_bad_geometry_are_refused(tmp_path):
    pf = sparse(str(tmp_path / "p.pool"))
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        pf.take([64])
    with pytest.raises(ValueError, match="multiple of 4096"):
        ExtentMap(DATA_OFFSET, 100, 10, 5000)
    with pytest.raises(ValueError, match="holds the header"):
        pf.extent_map.mark_punched(0)
    assert pf.take([20])
    with pytest.raises(ValueError, match="1 slots use it"):
        pf.extent_map.mark_punched(5)
    check(pf)


def test_the_default_extent_is_2_mib_and_page_aligned():
    assert EXTENT_BYTES == 2 * MiB
    em = ExtentMap(DATA_OFFSET, 12345, 1000, EXTENT_BYTES)
    assert all(em.byte_range(k)[0] % 4096 == 0 for k in range(em.num_extents))
    assert em.charge(em.num_extents - 1) % 4096 == 0


def test_a_punched_block_fails_its_checksum_and_is_never_served(tmp_path, make_store):
    """A block the index still names whose extent was punched (a punch the index did not
    expect) reads as zeros: ``verify`` says so, and a promotion with ``verify=`` drops it
    instead of serving it. The storage checksum path, on a sparse disk pool file."""
    state = tmp_path / "state"
    state.mkdir()
    path = str(state / "t.disk.pool")
    pf = sparse(path, header(num_slots=32), extent_bytes=EXT)
    slots = [0, 1, 2, 9, 10]                # extent 0 and extent 2
    assert pf.take(slots)
    store = make_store(device=4, host=8, disk=32, file_ids={Tier.DISK: pf.file_id})
    blocks = block_data(SMALL, range(5))
    store.write(Tier.DISK, slots, blocks)
    store.sync(Tier.DISK)
    sums = store.checksum(Tier.DISK, slots)
    assert store.verify(Tier.DISK, slots, sums) == [True] * 5
    pf.give_back([9, 10])                   # the slots are freed behind the index's back
    assert pf.shrink() == EXT
    assert store.verify(Tier.DISK, slots, sums) == [True, True, True, False, False]
    host = store.allocator(Tier.HOST).allocate(5)
    result = store.copy(Tier.DISK, slots, Tier.HOST, host, verify=sums)
    assert result.ok == [True, True, True, False, False]
    got = store.read(Tier.HOST, host)
    assert same_bytes(got[:3], blocks[:3])
    assert torch.count_nonzero(got[3:].view(torch.uint8)) == 0   # never written: not served
    # a recovery that names the punched blocks allocates zeros there: still dropped
    pf.close()
    again = sparse(path, pf.header, expect_file_id=True)
    again.recover(slots)
    check(again)
    assert store.verify(Tier.DISK, slots, sums) == [True, True, True, False, False]


def test_a_truncated_sparse_file_is_extended_as_a_hole(tmp_path):
    """A sparse file cut short behind our back comes back at full size without allocating the
    rest (the preallocated pools' re-extend would fallocate all of it)."""
    path = str(tmp_path / "p.pool")
    pf = sparse(path, header(num_slots=512))
    assert pf.take([3])
    pf.close()
    os.truncate(path, 8192)
    again = sparse(path, pf.header, expect_file_id=True)
    assert os.fstat(again.fd).st_size == DATA_OFFSET + 512 * SMALL.block_bytes
    again.recover([3])
    check(again)
    assert again.held_bytes() <= 2 * EXT + METADATA_SLACK


@pytest.mark.parametrize("block_bytes", [SMALL.block_bytes, 12345, 3 * EXT + 512])
def test_a_random_walk_matches_a_plain_model(where, block_bytes):
    """Random takes, give-backs and shrinks against a model that recomputes, from the slots
    in use, which extents must be held; invariants and the filesystem's count after every
    step. Planted bug this catches: ``ExtentMap.touched`` counting only a slot's first
    extent (a straddling slot's second extent is punched under it)."""
    import random

    rng = random.Random(block_bytes)
    num_slots = 96
    led = BudgetLedger("disk", 64 * MiB)
    pf = sparse(os.path.join(where, "p.pool"), header(block_bytes=block_bytes, num_slots=num_slots),
                ledger=led)
    used: set[int] = set()
    allocated = {0}

    def touches(s):
        start = DATA_OFFSET + s * block_bytes
        return set(range(start // EXT, (start + block_bytes - 1) // EXT + 1))

    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            free = sorted(set(range(num_slots)) - used)
            slots = rng.sample(free, min(rng.randrange(1, 6), len(free)))
            assert pf.take(slots)
            used |= set(slots)
            for s in slots:
                allocated |= touches(s)
        elif op < 0.85 and used:
            slots = rng.sample(sorted(used), rng.randrange(1, min(6, len(used)) + 1))
            pf.give_back(slots)
            used -= set(slots)
        else:
            keep = rng.randrange(0, 3)
            needed = {0}.union(*(touches(s) for s in used)) if used else {0}
            idle = sorted(allocated - needed)
            pf.shrink(keep_idle=keep)
            allocated -= set(idle[keep:])
        check(pf)
        assert set(pf.extent_map.allocated_extents()) == allocated


@pytest.mark.parametrize("block_bytes", [4096, 12345, 5 * EXT + 100])
def test_the_bulk_path_counts_what_the_per_slot_path_counts(block_bytes):
    """Recovery hands over its slots at once (numpy path, >= ``_BULK`` slots); a request a few
    at a time (list path): both count every extent a slot touches."""
    import random

    slots = random.Random(3).sample(range(20000), 6000)
    bulk, small = (ExtentMap(DATA_OFFSET, block_bytes, 20000, EXT) for _ in range(2))
    for em in (bulk, small):
        for k in em.extents_of(slots):
            em.mark_allocated(k)
    bulk.add_users(slots)
    for i in range(0, len(slots), 7):
        small.add_users(slots[i:i + 7])
    assert [bulk.users_of(k) for k in range(bulk.num_extents)] == \
        [small.users_of(k) for k in range(small.num_extents)]
    assert bulk.idle() == small.idle()
    bulk.add_users(slots, -1)
    assert bulk.num_users == 0 and bulk.idle() == [k for k in bulk.allocated_extents() if k]
    bulk.check_invariants()
    small.check_invariants()


def test_a_mapping_of_the_whole_range_costs_nothing_until_extents_grow(tmp_path):
    """What spares clients remapping: the file is mapped whole, once (without MAP_POPULATE,
    which would allocate every page of a sparse shm file), and only grown extents take
    memory; stores into them through the mapping land in the file."""
    import mmap

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="prefixd-extents-")
    try:
        pf = sparse(os.path.join(directory, "p.pool"), header(num_slots=4096), budget=128 * MiB,
                    durable=False)                        # 64 MiB of slots
        mapping = mmap.mmap(pf.fd, pf.extent_map.file_bytes, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        check(pf)
        assert pf.held_bytes() == EXT
        slots = [1000, 1001, 3000]
        assert pf.take(slots)
        bb = SMALL.block_bytes
        for s in slots:
            mapping[DATA_OFFSET + s * bb:DATA_OFFSET + (s + 1) * bb] = bytes([s % 251]) * bb
        check(pf)
        assert pf.held_bytes() == 3 * EXT                 # the header's, 1000-1001's, 3000's
        assert read_slot(pf, 3000) == bytes([3000 % 251]) * bb
        mapping.close()
        pf.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
