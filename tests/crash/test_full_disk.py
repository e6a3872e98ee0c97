"""Full disk and failing fsync: no crash, no SIGBUS, nothing acknowledged that is not durable.

* A small tmpfs mounted on the state directory (root only; skipped otherwise): a disk pool whose
  first extent does not fit is refused at start with the asked and free bytes; one whose file is
  larger than the filesystem serves on, its refused grows a full disk tier; a state directory that fits the
  pools but whose LMDB file runs out of room while committing fails that commit, poisons the log,
  and after space is freed a reopen finds every acknowledged commit intact.
* An fsync that fails once (the WAL's inside LMDB's commit, or the disk pool's ``fdatasync``):
  the commit raises, nothing after it is acknowledged (a failed fsync is never retried into a
  success: the kernel may have dropped the pages it failed to write), the process goes on, and a
  reopen recovers everything acknowledged before the failure.

Acknowledgements are kept as ``tests.crash.prefixd_workload`` writes them (``power <hex tokens>``)
and checked with its ``check`` (recover, every ack a full hit with the right bytes, invariants).
"""

from __future__ import annotations

import errno
import os
import subprocess

import lmdb
import pytest

from prefixd.engine.durable import DurableCache
from prefixd.storage.errors import SpaceError, StorageError
from prefixd.api.layout import KVLayout
from prefixd.storage.extents import EXTENT_BYTES
from prefixd.storage.poolfile import free_bytes
from prefixd.api.tiers import Tier
from prefixd.wal import WalFailedError, WalNoSpaceError
from tests.cache.helpers import StoreTokens
from tests.crash.prefixd_workload import BS, LAYOUT, ack_line, check, open_cache
from tests.requires import missing

SIZES = (24, 24, 4096)  # small enough for the 1-2 MiB tmpfs these tests mount


@pytest.fixture
def tmpfs(tmp_path):
    """Factory: ``tmpfs(size_bytes) -> path`` of a fresh tmpfs of that size under ``tmp_path``;
    skips when not root or when mounting fails (fails under ``.ci/run``: ``tests.requires``);
    every mount is unmounted at teardown."""
    if os.geteuid() != 0:
        missing("mounting a small tmpfs on the state directory needs root")
    mounted: list[str] = []

    def factory(size: int, name: str = "state") -> str:
        path = tmp_path / name
        path.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            missing(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
        mounted.append(str(path))
        return str(path)

    yield factory
    for path in reversed(mounted):
        if subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def shm_dir(tmp_path):
    path = tmp_path / "shm"
    path.mkdir()
    return str(path)


def _prompt(i: int, num_blocks: int = 10) -> list[int]:
    return [100_000 * (i + 1) + k for k in range(num_blocks * BS + 1)]


def _ack(tokens: list[int]) -> str:
    return ack_line("power", tokens)


def _serve(dc: DurableCache, tokens: list[int]) -> None:
    """Open, write KV, commit at ``power``, release: returns only if the commit was acknowledged."""
    seq = dc.open(tokens)
    StoreTokens(dc.store, BS).write(seq.block_table, tokens, seq.cached_tokens)
    dc.commit(seq.id, "power").result()
    dc.release(seq.id)


def _open_with_acks(state: str, shm_dir: str) -> tuple[DurableCache, list[str]]:
    """A cache on ``state`` with the first three prompts served; it and their acks."""
    dc = open_cache(state, shm_dir, SIZES)
    acks = []
    for i in range(3):
        _serve(dc, _prompt(i))
        acks.append(_ack(_prompt(i)))
    return dc, acks


def _close_poisoned(dc: DurableCache) -> None:
    """Close a cache whose log is poisoned: close still releases everything, then may re-raise."""
    try:
        dc.close()
    except WalFailedError:
        pass
    assert dc.wal._closed


def test_a_disk_pool_whose_first_extent_does_not_fit_is_refused_at_start_with_asked_and_free_bytes(tmpfs, shm_dir):
    """Guards against a disk pool that is created on a full filesystem and SIGBUSes or fails
    later, and against a refusal that does not say how much was asked and how much is free. A
    pool file is sparse: what it needs at start is its header's extent (2 MiB here)."""
    state = tmpfs(1 << 20)
    num_disk = 64 << 10  # 64 Ki blocks of 64 bytes: a 4 MiB file on a 1 MiB filesystem
    with pytest.raises(SpaceError) as err:
        DurableCache(state, LAYOUT, (SIZES[0], SIZES[1], num_disk), shm_dir=shm_dir)
    exc = err.value
    assert exc.needed_bytes == EXTENT_BYTES
    assert 0 < exc.free_bytes < exc.needed_bytes
    assert abs(exc.free_bytes - free_bytes(state)) <= 64 << 10
    msg = str(exc)
    assert f"asked for {exc.needed_bytes} bytes" in msg and f"free on its filesystem: {exc.free_bytes} bytes" in msg
    assert exc.path.startswith(state) and exc.path in msg
    assert not [n for n in os.listdir(state) if n.endswith(".tmp")], "a half-made pool file was left"
    dc = open_cache(state, shm_dir, SIZES)  # the state directory is still usable with pools that fit
    try:
        _serve(dc, _prompt(0))
    finally:
        dc.close()
    check(state, shm_dir, [_ack(_prompt(0))], sizes=SIZES)


def test_a_disk_pool_file_larger_than_its_filesystem_serves_and_its_grows_are_refused(tmpfs, shm_dir):
    """Guards against a sparse disk pool that SIGBUSes, fails a commit or loses an acknowledged
    one when its filesystem fills: a grow that meets ENOSPC is a full disk tier (no slot
    handed out, ``no_space`` says so), ``crash`` commits go on through the host tier, and
    every acknowledged commit is there after a restart."""
    state = tmpfs(4 << 20)
    wide = (24, 24, 4096)  # 16 MiB of 4 KiB blocks on a 4 MiB filesystem
    layout = KVLayout("full-disk-wide", num_layers=1, num_kv_heads=1, head_dim=128, dtype="float32",
                      block_size=BS)
    dc = DurableCache(state, layout, wide, shm_dir=shm_dir, reclaim_grace_s=0.0, spill_blocks=8)
    acks: list[list[int]] = []
    try:
        for i in range(200):  # 2,000 blocks, 8 MiB: the disk fills on the way
            tokens = _prompt(i)
            seq = dc.open(tokens)
            StoreTokens(dc.store, BS).write(seq.block_table, tokens, seq.cached_tokens)
            dc.commit(seq.id, "crash").result()
            dc.release(seq.id)
            acks.append(tokens)
        refused, now = dc.store.no_space(Tier.DISK)
        assert refused > 0, "the disk never filled: the test proves nothing"
        assert os.stat(dc.store.pool(Tier.DISK).path).st_blocks * 512 <= 4 << 20
    finally:
        dc.close()
    dc = DurableCache(state, layout, wide, shm_dir=shm_dir, reclaim_grace_s=0.0)
    try:
        for tokens in acks[-5:]:  # the newest: the disk's LRU made room for them
            full = len(tokens) // BS * BS
            seq = dc.open(tokens[:full] + [0])
            assert seq.cached_tokens == full, "an acknowledged commit the disk had room for is gone"
            StoreTokens(dc.store, BS).check(seq.block_table[:full // BS], tokens[:full])
            dc.release(seq.id)
        dc.check_invariants()
    finally:
        dc.close()


def test_lmdb_out_of_space_fails_the_commit_and_keeps_every_acknowledged_one(tmpfs, shm_dir):
    """Guards against a commit acknowledged although its records could not be written (ENOSPC
    from LMDB), against a SIGBUS or a dead process when LMDB cannot grow, and against losing
    earlier acknowledged commits once space is back."""
    state = tmpfs(2 << 20)
    dc = open_cache(state, shm_dir, SIZES)
    filler = os.path.join(state, "filler")
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, free_bytes(state) - (64 << 10))  # leave LMDB 64 KiB to grow in
    finally:
        os.close(fd)
    acks: list[str] = []
    failure = None
    for i in range(SIZES[2] // 10 - 1):  # never more than the disk tier holds: nothing is evicted
        tokens = _prompt(i)
        try:
            _serve(dc, tokens)
        except WalFailedError as exc:
            failure = exc
            break
        acks.append(_ack(tokens))
    assert failure is not None, f"LMDB never ran out of space in {len(acks)} commits"
    assert acks, "the first commit already failed: the filler left too little room"
    assert isinstance(failure.__cause__, lmdb.Error), repr(failure.__cause__)
    # ENOSPC, or EIO: LMDB reports a write cut short by a full filesystem as EIO
    cause = str(failure.__cause__)
    assert "No space left" in cause or "Input/output error" in cause, failure.__cause__
    with pytest.raises(WalFailedError):
        _serve(dc, _prompt(10_000, num_blocks=1))  # poisoned: never acknowledged again,
    os.unlink(filler)
    with pytest.raises(WalFailedError):
        _serve(dc, _prompt(10_001, num_blocks=1))  # not even once space is back
    _close_poisoned(dc)
    result = check(state, shm_dir, acks, sizes=SIZES)
    assert result["acks"] == len(acks)


def test_a_checkpoint_on_a_full_filesystem_fails_cleanly_and_is_retried(tmpfs, shm_dir, caplog):
    """Guards against a checkpoint that meets ENOSPC poisoning the log (every later commit
    DATA_LOSS, as a commit's ENOSPC must): the checkpoint's transaction is aborted before its
    meta page, so it raises ``WalNoSpaceError``, the log keeps every record and commits go on;
    the trigger's checkpoint logs one WARNING and waits before it tries again; once space is
    back a checkpoint is taken and a reopen finds every acknowledged commit."""
    state = tmpfs(2 << 20)
    dc = open_cache(state, shm_dir, SIZES, checkpoint_records=1 << 30)
    acks = []
    for i in range(300):  # ~3,000 blocks: a checkpoint of some 100 KiB
        tokens = _prompt(i)
        _serve(dc, tokens)
        acks.append(_ack(tokens))
    filler = os.path.join(state, "filler")
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, free_bytes(state) - (16 << 10))  # 16 KiB: commits, not a checkpoint
    finally:
        os.close(fd)
    with pytest.raises(WalNoSpaceError):
        dc.checkpoint()
    assert dc.wal.failure is None  # not poisoned
    tokens = _prompt(5_000, num_blocks=1)
    _serve(dc, tokens)  # still acknowledged
    acks.append(_ack(tokens))
    dc.checkpoint_records = 1  # the trigger's checkpoint: postponed, said once
    with caplog.at_level("WARNING", logger="prefixd.engine.upkeep"):
        dc.upkeep.checkpoint_due()
        dc.upkeep.checkpoint_due()  # postponed: not due again yet
    warnings = [r for r in caplog.records if "checkpoint postponed" in r.getMessage()]
    assert len(warnings) == 1 and not dc.upkeep.trigger.due()
    os.unlink(filler)
    assert dc.checkpoint() > 0  # space is back
    assert dc.upkeep.trigger.not_before == 0.0
    dc.close()
    assert check(state, shm_dir, acks, sizes=SIZES)["acks"] == len(acks)


def test_a_failed_wal_fsync_poisons_the_log_and_is_never_retried(tmp_path, shm_dir, monkeypatch):
    """Guards against a commit acknowledged after its group's fsync failed, and against the
    committer retrying the failed group (a later fsync "succeeding" over pages the kernel
    dropped): the failure must poison the log for good, and a restart recovers the rest."""
    state = str(tmp_path / "state")
    dc, acks = _open_with_acks(state, shm_dir)
    wenv = dc.wal._wenv
    real_write = wenv.write
    calls = {"failed": 0, "after": 0}

    def write(fn):
        if not calls["failed"]:
            calls["failed"] = 1  # as mdb_txn_commit does when its fdatasync fails: txn aborted
            raise lmdb.DiskError("mdb_txn_commit: fdatasync: Input/output error (injected)")
        calls["after"] += 1
        return real_write(fn)

    monkeypatch.setattr(wenv, "write", write)
    with pytest.raises(WalFailedError) as err:
        _serve(dc, _prompt(3))
    assert isinstance(err.value.__cause__, lmdb.DiskError)
    with pytest.raises(WalFailedError):
        _serve(dc, _prompt(4))
    with pytest.raises(WalFailedError):
        dc.wal.commit_now()
    assert dc.wal.failure is not None
    assert calls["after"] == 0, "the log wrote again after a failed fsync"
    _close_poisoned(dc)
    assert calls["after"] == 0, "close retried the failed group"
    assert check(state, shm_dir, acks, sizes=SIZES)["acks"] == 3


def test_a_failed_disk_pool_fdatasync_fails_the_commit_and_is_never_retried(tmp_path, shm_dir, monkeypatch):
    """Guards against a power commit acknowledged after the disk pool's fdatasync failed, or
    after a retried fdatasync "succeeded" over pages the kernel dropped (fsyncgate): no later
    power commit may be acknowledged by that process, and a restart recovers every earlier one."""
    state = str(tmp_path / "state")
    dc, acks = _open_with_acks(state, shm_dir)
    pool_fd = dc.store.pool(Tier.DISK).fd
    real_fdatasync = os.fdatasync
    calls = {"failed": 0, "after": 0}

    def fdatasync(fd):
        if fd == pool_fd:
            if not calls["failed"]:
                calls["failed"] = 1
                raise OSError(errno.EIO, "Input/output error (injected)")
            calls["after"] += 1
        return real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with pytest.raises(WalFailedError) as err:
        _serve(dc, _prompt(3))
    assert isinstance(err.value.__cause__, StorageError) and "fdatasync" in str(err.value.__cause__)
    assert dc.wal.failure is err.value
    for i in (4, 5):
        with pytest.raises(WalFailedError):
            _serve(dc, _prompt(i, num_blocks=1))
    assert calls["after"] == 0, "the disk pool's fdatasync was retried after it failed"
    _close_poisoned(dc)
    assert check(state, shm_dir, acks, sizes=SIZES)["acks"] == 3
