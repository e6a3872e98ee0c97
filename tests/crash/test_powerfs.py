"""PowerFS proves itself: what it keeps and drops at a power cut, and that it can see real loss.

Each test mounts a real FUSE filesystem (skipped where FUSE is unavailable). Workloads that must
survive a cut run in child processes that `power_cut` SIGKILLs; the test process only writes
directly for the plain-file tests, and closes its descriptors before the cut.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
import sys
import time

import pytest

from tests.crash.acklog import read_acks, wait_for_acks
from tests.crash.powerfs import PAGE_SIZE, PowerFS, PowerFSError, fuse_unavailable_reason
from tests.crash.workloads import check_lmdb_in_child

log = logging.getLogger(__name__)
NUM_PAGES = 16


def _page(tag: bytes, idx: int) -> bytes:
    return (tag + idx.to_bytes(4, "little")) * (PAGE_SIZE // (len(tag) + 4))


def _write_file(path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torn_result(powerfs, seed: int, name: str) -> list[str]:
    """16 synced 'old' pages overwritten by 16 unsynced 'new' ones, cut torn: who won, per page."""
    old = b"".join(_page(b"old-", i) for i in range(NUM_PAGES))
    new = b"".join(_page(b"new-", i) for i in range(NUM_PAGES))
    with powerfs(name, seed=seed, mode="torn") as fs:
        _write_file(fs.mnt / "f", old, sync=True)
        _write_file(fs.mnt / "f", new, sync=False)
        assert (fs.mnt / "f").read_bytes() == new
        report = fs.power_cut()
    assert report.pages_kept + report.pages_lost == NUM_PAGES
    data = (fs.backing / "f").read_bytes()
    assert len(data) == len(old)
    result = []
    for i in range(NUM_PAGES):
        page = data[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
        assert page in (_page(b"old-", i), _page(b"new-", i)), f"page {i} is neither old nor new"
        result.append("new" if page == _page(b"new-", i) else "old")
    assert result.count("new") == report.pages_kept
    return result


# ---- (a) plain files ---------------------------------------------------------------------

def test_fsynced_write_survives_and_unsynced_write_is_lost_in_lose_mode(powerfs):
    with powerfs(mode="lose") as fs:
        _write_file(fs.mnt / "synced", b"a" * 10_000, sync=True)
        _write_file(fs.mnt / "unsynced", b"b" * 10_000, sync=False)
        _write_file(fs.mnt / "synced", b"c" * 100, sync=False)  # an unsynced overwrite
        _fsync_dir(fs.mnt)  # both names durable; only the first file's data
        assert (fs.mnt / "synced").read_bytes()[:101] == b"c" * 100 + b"a"
        report = fs.power_cut()
    assert (fs.backing / "synced").read_bytes() == b"a" * 10_000
    assert (fs.backing / "unsynced").read_bytes() == b""  # the name survived, the data did not
    assert report.pages_lost == 1 + 3 and report.pages_kept == 0


def test_torn_mode_keeps_some_pages_and_is_deterministic_per_seed(powerfs):
    results = {seed: _torn_result(powerfs, seed, f"s{seed}") for seed in range(4)}
    assert any("new" in r and "old" in r for r in results.values()), results
    assert len({tuple(r) for r in results.values()}) > 1, "every seed tore the same pages"
    assert _torn_result(powerfs, 2, "again") == results[2]


def test_torn_mode_size_change_is_kept_or_lost_whole(powerfs):
    """An unsynced append: the file is either the synced length or the written length."""
    sizes = set()
    for seed in range(6):
        with powerfs(f"s{seed}", seed=seed, mode="torn") as fs:
            _write_file(fs.mnt / "f", b"x" * 5000, sync=True)
            with open(fs.mnt / "f", "ab") as f:
                f.write(b"y" * 9000)
            fs.power_cut()
        data = (fs.backing / "f").read_bytes()
        assert data[:4096] == b"x" * 4096 and len(data) in (5000, 14000)
        sizes.add(len(data))
    assert sizes == {5000, 14000}


def test_truncate_then_extend_reads_zeros_before_and_after_a_sync(powerfs):
    with powerfs() as fs:
        _write_file(fs.mnt / "f", b"q" * 12_000, sync=True)
        fd = os.open(fs.mnt / "f", os.O_RDWR)
        os.ftruncate(fd, 100)
        os.ftruncate(fd, 12_000)
        assert os.pread(fd, 12_000, 0) == b"q" * 100 + bytes(11_900)
        os.close(fd)
        fs.check()
        fs.power_cut()
    assert (fs.backing / "f").read_bytes() == b"q" * 12_000  # the truncate was never synced
    with powerfs() as fs:  # remount the durable state
        fd = os.open(fs.mnt / "f", os.O_RDWR)
        os.ftruncate(fd, 100)
        os.ftruncate(fd, 12_000)
        os.fdatasync(fd)
        os.close(fd)
        fs.power_cut()
    assert (fs.backing / "f").read_bytes() == b"q" * 100 + bytes(11_900)


def test_o_dsync_write_is_durable_without_fsync(powerfs):
    with powerfs() as fs:
        _write_file(fs.mnt / "f", b"", sync=True)
        fd = os.open(fs.mnt / "f", os.O_RDWR | os.O_DSYNC)
        os.pwrite(fd, b"meta" * 1024, 0)
        os.close(fd)
        assert fs.stats()["counters"]["write_sync"] == 1
        fs.power_cut()
    assert (fs.backing / "f").read_bytes() == b"meta" * 1024


def test_shared_mmap_msync_is_durable_and_unsynced_mmap_writes_are_lost(powerfs):
    """Shared writable mmap works through the page cache; msync(MS_SYNC) = writes + fsync."""
    size = 8 * PAGE_SIZE
    with powerfs() as fs:
        _write_file(fs.mnt / "pool", bytes(size), sync=True)
        fd = os.open(fs.mnt / "pool", os.O_RDWR)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[0:5] = b"synced"[:5]
        m[5 * PAGE_SIZE : 5 * PAGE_SIZE + 5] = b"also!"
        m.flush()  # msync(MS_SYNC)
        m[2 * PAGE_SIZE : 2 * PAGE_SIZE + 5] = b"gone!"
        m.close()
        os.close(fd)
        counters = fs.stats()["counters"]
        fs.power_cut()
    assert counters["fdatasync"] + counters["fsync"] >= 2
    data = (fs.backing / "pool").read_bytes()
    assert data[:5] == b"synce" and data[5 * PAGE_SIZE : 5 * PAGE_SIZE + 5] == b"also!"
    assert data[2 * PAGE_SIZE : 2 * PAGE_SIZE + 5] == bytes(5)


# ---- (d) namespace rules -----------------------------------------------------------------

def test_rename_is_durable_only_after_directory_fsync(powerfs):
    with powerfs("nodirsync") as fs:
        _write_file(fs.mnt / "f.tmp", b"payload", sync=True)  # creation durable as f.tmp
        os.rename(fs.mnt / "f.tmp", fs.mnt / "f")
        fs.power_cut()
    assert sorted(os.listdir(fs.backing)) == ["f.tmp"]
    assert (fs.backing / "f.tmp").read_bytes() == b"payload"

    with powerfs("dirsync") as fs:
        _write_file(fs.mnt / "f.tmp", b"payload", sync=True)
        os.rename(fs.mnt / "f.tmp", fs.mnt / "f")
        _fsync_dir(fs.mnt)
        fs.power_cut()
    assert sorted(os.listdir(fs.backing)) == ["f"]
    assert (fs.backing / "f").read_bytes() == b"payload"


def test_new_file_without_fsync_is_lost_and_file_fsync_makes_parents_durable(powerfs):
    with powerfs() as fs:
        os.makedirs(fs.mnt / "a" / "b")
        _write_file(fs.mnt / "a" / "b" / "kept", b"k", sync=True)
        _write_file(fs.mnt / "a" / "lost", b"l", sync=False)
        os.mkdir(fs.mnt / "emptydir")
        fs.power_cut()
    assert sorted(os.listdir(fs.backing)) == ["a"]
    assert sorted(os.listdir(fs.backing / "a")) == ["b"]
    assert (fs.backing / "a" / "b" / "kept").read_bytes() == b"k"


def test_unlink_is_durable_only_after_directory_fsync(powerfs):
    with powerfs("prep") as fs:
        _write_file(fs.mnt / "x", b"1", sync=True)
        _write_file(fs.mnt / "y", b"2", sync=True)
        fs.unmount()  # orderly: everything durable
    with PowerFS(fs.root) as again:
        os.unlink(again.mnt / "x")
        os.unlink(again.mnt / "y")
        fd = os.open(again.mnt, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        _write_file(again.mnt / "z", b"3", sync=False)
        os.unlink(again.mnt / "z")
        again.power_cut()
    assert os.listdir(fs.backing) == []


def test_leaving_the_block_on_an_exception_cuts_and_unmounts(powerfs):
    fs = powerfs()
    with pytest.raises(RuntimeError, match="workload bug"):
        with fs:
            _write_file(fs.mnt / "f", b"durable", sync=True)
            fs.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("workload bug")
    assert not os.path.ismount(fs.mnt) and fs.children == []
    assert (fs.backing / "f").read_bytes() == b"durable"
    with pytest.raises(PowerFSError, match="not mounted"):
        fs.power_cut()


# ---- (b), (c) LMDB -----------------------------------------------------------------------

def _lmdb_cycle(fs: PowerFS, seed: int, *, nosync: bool,
                ack_name: str = "acks") -> tuple[list[str], int]:
    """Run the LMDB workload to a seeded number of acks (+ a seeded delay), cut, check."""
    rng = random.Random(seed)
    ack_path = fs.root / ack_name
    err_path = fs.root / f"{ack_name}.stderr"
    with fs, open(err_path, "wb") as err:
        child = fs.spawn([sys.executable, "-m", "tests.crash.workloads", "lmdb",
                          str(fs.mnt / "db"), str(ack_path), "--seed", str(seed),
                          *(["--nosync"] if nosync else [])], stderr=err)
        wait_for_acks(ack_path, rng.randint(5, 60), proc=child)
        assert child.poll() is None, f"the workload died: {err_path.read_text()[-2000:]}"
        time.sleep(rng.uniform(0, 0.004))
        fs.check()
        report = fs.power_cut()
    acks = read_acks(ack_path)
    problems = check_lmdb_in_child(fs.backing / "db", ack_path, seed)
    log.info("seed=%d nosync=%s acks=%d problems=%d report=%s", seed, nosync, len(acks),
             len(problems), report)
    return problems, report.pages_kept + report.pages_lost


@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_control_lmdb_without_sync_is_caught_losing_acknowledged_commits(powerfs, mode):
    """sync=False, metasync=False: commits acked but never synced. The harness must see loss."""
    caught = [bool(_lmdb_cycle(powerfs(f"s{seed}", seed=seed, mode=mode), seed, nosync=True)[0])
              for seed in range(4)]
    assert any(caught), f"{mode}: no seed lost an acknowledged commit: the harness is blind"


def _synced_lmdb_survives(powerfs, mode: str, seeds: range) -> None:
    torn_pages = 0
    for seed in seeds:
        problems, num_dirty = _lmdb_cycle(powerfs(f"s{seed}", seed=seed, mode=mode), seed,
                                          nosync=False)
        assert problems == [], f"{mode} seed {seed}: {problems[:10]}"
        torn_pages += num_dirty
    log.info("%s: %d unsynced pages at the cuts over %d seeds", mode, torn_pages, len(seeds))


@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_lmdb_synced_commits_survive_power_cut(powerfs, mode):
    _synced_lmdb_survives(powerfs, mode, range(10))


@pytest.mark.soak
@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_lmdb_synced_commits_survive_power_cut_soak(powerfs, mode):
    _synced_lmdb_survives(powerfs, mode, range(100, 200))


def test_remount_continues_from_the_durable_state(powerfs):
    fs = powerfs(seed=1)
    assert _lmdb_cycle(fs, 1, nosync=False, ack_name="acks1")[0] == []
    assert _lmdb_cycle(fs, 1, nosync=False, ack_name="acks2")[0] == []  # reopens the cut env
    # The first run's new keys are still there (its hot keys were legitimately rewritten).
    problems = check_lmdb_in_child(fs.backing / "db", fs.root / "acks1", 1)
    assert [p for p in problems if p.startswith("n")] == []


# ---- (e) detection -----------------------------------------------------------------------

def test_fuse_unavailable_reason_names_each_missing_piece(tmp_path):
    dev = tmp_path / "fuse"
    dev.touch()
    ok = dict(euid=0, dev_fuse=str(dev), fusermount="sh", binding="json", library="c")
    assert fuse_unavailable_reason(**ok) is None
    assert "root" in fuse_unavailable_reason(**dict(ok, euid=1000))
    assert "does not exist" in fuse_unavailable_reason(**dict(ok, dev_fuse=str(tmp_path / "no")))
    assert "fusermount-nope" in fuse_unavailable_reason(**dict(ok, fusermount="fusermount-nope"))
    assert "not installed" in fuse_unavailable_reason(**dict(ok, binding="no_such_binding_x"))
    assert "libno-such-lib-x" in fuse_unavailable_reason(**dict(ok, library="no-such-lib-x"))


def test_powerfs_refuses_a_bad_mode_and_a_second_mount(powerfs, tmp_path):
    with pytest.raises(PowerFSError, match="mode"):
        PowerFS(tmp_path / "x", mode="gentle")
    with powerfs() as fs:
        with pytest.raises(PowerFSError, match="already mounted"):
            fs.mount()
        with pytest.raises(PowerFSError, match="already a mount point"):
            PowerFS(fs.root).mount()
