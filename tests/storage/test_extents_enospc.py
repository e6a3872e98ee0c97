"""Sparse pool files on a real, small tmpfs (root only; skipped otherwise): a grow that meets
ENOSPC is a typed ``NoSpaceError`` that takes nothing, and an extent once grown never meets
ENOSPC, through ``pwrite`` or a shared mapping, however full the filesystem gets."""

import errno
import os
import subprocess
import sys

import pytest

from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import NoSpaceError
from prefixd.storage.extents import EXTENT_BYTES, SparsePoolFile
from prefixd.storage.poolfile import DATA_OFFSET
from tests.storage.test_extents import check, header

MiB = 1 << 20
BLOCK = 256 * 1024                      # 8 blocks per 2 MiB extent
SLOTS_PER_EXTENT = EXTENT_BYTES // BLOCK


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh 8 MiB tmpfs under ``tmp_path``; unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = tmp_path / "fs"
    path.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    yield str(path)
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def pool(directory, budget=64 * MiB):
    """A pool file sized for a 64 MiB budget on an 8 MiB filesystem: the budget is not what
    stops it, the filesystem is."""
    hdr = header(block_bytes=BLOCK, num_slots=(budget - DATA_OFFSET) // BLOCK)
    return SparsePoolFile(os.path.join(directory, "p.pool"), hdr,
                          ledger=BudgetLedger("host", budget), tenant="t", durable=False)


def slots_of_extent(k):
    """The slots wholly inside extent ``k`` (the first slot of each extent straddles the
    previous one: slots start 4 KiB after each 2 MiB boundary)."""
    return list(range(k * SLOTS_PER_EXTENT, (k + 1) * SLOTS_PER_EXTENT - 1))


def fill(directory) -> str:
    """Write a file until the filesystem is full; returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\xff" * 65536
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        try:
            while True:
                os.write(fd, b"\xff" * 4096)
        except OSError:
            pass
    finally:
        os.close(fd)
    return path


def test_a_grow_that_meets_enospc_is_a_typed_error_and_takes_nothing(tmpfs):
    pf = pool(tmpfs)
    taken = 0
    with pytest.raises(NoSpaceError) as err:
        for k in range(32):
            assert pf.take(slots_of_extent(k))
            taken = k + 1
            check(pf)
    assert 2 <= taken <= 4                  # 8 MiB hold at most four 2 MiB extents
    assert err.value.path == pf.path and err.value.needed_bytes == EXTENT_BYTES
    assert "no room to grow" in str(err.value) and pf.path in str(err.value)
    check(pf)
    assert pf.charged == taken * EXTENT_BYTES
    assert not any(pf.extent_map.users_of(k) for k in range(taken, pf.extent_map.num_extents))
    # giving an extent back makes room for the next grow
    pf.give_back(slots_of_extent(1))
    assert pf.shrink() == EXTENT_BYTES
    assert pf.take(slots_of_extent(taken))
    check(pf)


def test_a_failed_grow_keeps_no_part_of_the_run_that_failed(tmpfs):
    """Neighbouring extents are one fallocate; the run that meets ENOSPC is punched again
    and charged nothing, a run before it that succeeded stays (idle, charged) until
    ``shrink``."""
    pf = pool(tmpfs)
    assert pf.take(slots_of_extent(1))
    filler = fill(tmpfs)
    os.truncate(filler, os.stat(filler).st_size - EXTENT_BYTES - 64 * 1024)  # room for one
    with pytest.raises(NoSpaceError):
        pf.take(slots_of_extent(2) + slots_of_extent(3))       # one run of two: all or nothing
    check(pf)
    assert pf.charged == 2 * EXTENT_BYTES and pf.extent_map.idle() == []
    with pytest.raises(NoSpaceError):
        pf.take(slots_of_extent(2) + slots_of_extent(4))       # two runs: the first one fits
    check(pf)
    assert pf.charged == 3 * EXTENT_BYTES and pf.extent_map.idle() == [2]
    assert pf.shrink() == EXTENT_BYTES
    check(pf)


def test_a_grown_extent_never_meets_enospc_however_full_the_filesystem(tmpfs):
    """Planted bug this catches: ``_grow`` marking extents allocated without fallocating them
    (a sparse file without reservation): the writes below fail with ENOSPC, and the mapped
    store dies of SIGBUS."""
    pf = pool(tmpfs)
    slots = slots_of_extent(0)[1:] + slots_of_extent(1) + slots_of_extent(2)
    assert pf.take(slots)
    fill(tmpfs)
    for s in slots:                         # pwrite: the disk pool's path
        assert os.pwrite(pf.fd, b"\x5a" * BLOCK, DATA_OFFSET + s * BLOCK) == BLOCK
    check(pf)
    store = (f"import mmap, os\n"
             f"fd = os.open({pf.path!r}, os.O_RDWR)\n"
             f"m = mmap.mmap(fd, {pf.extent_map.file_bytes})\n"       # the whole range, once
             f"for s in {slots!r}:\n"
             f"    off = {DATA_OFFSET} + s * {BLOCK}\n"
             f"    m[off:off + {BLOCK}] = b'\\xa5' * {BLOCK}\n"
             f"m.flush()\n")
    child = subprocess.run([sys.executable, "-c", store], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, f"mapped stores failed ({child.returncode}): {child.stderr[-500:]}"
    assert os.pread(pf.fd, BLOCK, DATA_OFFSET + slots[-1] * BLOCK) == b"\xa5" * BLOCK
    check(pf)
