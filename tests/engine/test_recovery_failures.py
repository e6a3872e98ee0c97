"""Recoveries that fail: they end in a typed error, promptly, and leave nothing open behind.

Each test names the finding it guards against (issue 10, item 6).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from prefixd.cache.node import DISK
from prefixd.engine import DurableCache
from prefixd.engine.errors import TierLostError
from prefixd.wal import WalCorruptError
from tests.cache.helpers import StoreTokens, tiny_layout
from tests.crash.corruption_harness import commit_prompts, flip_token_bits

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "wal-hang-data.mdb.gz"  # tests/fixtures/README.md
BS = 2
LAYOUT = tiny_layout(BS)
SIZES = (16, 32, 64)

_OPEN_FIXTURE = """
    import json, sys, time
    from prefixd.api.layout import KVLayout
    from prefixd.engine import DurableCache
    from prefixd.wal import env
    if sys.argv[3] == "skip-walk":  # reach the prefetch on the damaged tree, as before the walk
        env.check_structure = lambda path, state_dir, max_map_size=None: None
    layout = KVLayout("crashverify-tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                      block_size=16)
    t = time.monotonic()
    try:
        DurableCache(sys.argv[1], layout, (256, 1024, 16384), shm_dir=sys.argv[2]).close()
        out = {"opened": True}
    except Exception as exc:
        out = {"error": [f"{k.__module__}.{k.__name__}" for k in type(exc).__mro__], "message": str(exc)}
    out["seconds"] = time.monotonic() - t
    print(json.dumps(out))
"""


@pytest.mark.parametrize("walk", ["walk", "skip-walk"])
def test_a_damaged_log_that_loops_the_prefetch_ends_in_a_typed_error(tmp_path, walk):
    """Regression: on this ``data.mdb`` (50 random bit flips) ``set_range`` answers with a key
    below the one asked for, so the log-prefetch thread looped forever, while recovery, having
    raised WalCorruptError on the checkpoint, joined that thread in a ``finally``: the open
    hung instead of raising. The open's bounds walk now refuses this file first (a page that
    stores another page number); ``skip-walk`` takes the walk out so the prefetch's own bound
    stays tested."""
    state, shm = tmp_path / "state", tmp_path / "shm"
    (state / "wal").mkdir(parents=True)
    shm.mkdir()
    with gzip.open(FIXTURE) as src, open(state / "wal" / "data.mdb", "wb") as dst:
        shutil.copyfileobj(src, dst)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(_OPEN_FIXTURE), str(state), str(shm), walk],
                               env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("opening the damaged state directory hung (killed after 120 s)")
    assert child.returncode == 0, child.stderr[-2000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert "prefixd.wal.errors.WalCorruptError" in got.get("error", []), got
    assert "corrupt write-ahead log" in got["message"], got
    assert ("fails the structural check" in got["message"]) == (walk == "walk"), got


# -- resources left behind by a refused recovery ------------------------------------------------------

def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _resources() -> tuple[set[str], set[str]]:
    """Open fds (as their targets, so a reused number still counts) and live threads."""
    fds = set()
    for fd in _open_fds():
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # the fd of the listing itself, closed by now
    return fds, {t.name for t in threading.enumerate()}


def _state(tmp_path, prompts, sizes=SIZES) -> tuple[str, str]:
    state, shm = str(tmp_path / "state"), str(tmp_path / "shm")
    os.makedirs(shm, exist_ok=True)
    dc = DurableCache(state, LAYOUT, sizes, shm_dir=shm)
    commit_prompts(dc, prompts)
    dc.close()
    return state, shm


def _damage_log(state: str, tokens: list[int]) -> None:
    """Flip a bit in every copy of ``tokens``' first two ids in ``data.mdb`` (the log record
    that carries them then fails its checksum; stale copies in freed pages are damaged too)."""
    flip_token_bits(os.path.join(state, "wal", "data.mdb"), tokens)


def test_a_recovery_refused_after_the_tiers_open_leaves_no_fd_or_thread_behind(tmp_path):
    """Regression: a recovery that failed after opening the tiers (here: a log record that
    fails its checksum, found by replay after the pools are open) leaked the pool fds, mappings and the
    log-prefetch thread; a daemon retrying would run out of both."""
    prompt = [1001 + i for i in range(9)]
    state, shm = _state(tmp_path, [prompt])
    _damage_log(state, prompt)
    with pytest.raises(WalCorruptError):  # once, so that lazy imports and caches are in place
        DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    before = _resources()
    for _ in range(3):
        with pytest.raises(WalCorruptError, match="checksum mismatch"):
            DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    after = _resources()
    assert after[0] == before[0], f"fds left open: {sorted(after[0] - before[0])}"
    assert after[1] == before[1], f"threads left running: {sorted(after[1] - before[1])}"


# -- a disk pool file that is gone ---------------------------------------------------------------------

PROMPTS = [[2001 + 10 * p + i for i in range(9)] for p in range(3)]


def _disk_pool(state: str) -> str:
    (name,) = [f for f in os.listdir(state) if f.endswith(".disk.pool")]
    return os.path.join(state, name)


def _num_disk_blocks(state: str, shm: str) -> int:
    dc = DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    try:
        return dc.cache.tree.num_blocks_in[DISK]
    finally:
        dc.close()


def test_a_missing_disk_pool_file_whose_blocks_are_indexed_is_refused(tmp_path):
    """Regression: a deleted disk pool file was recreated silently under its old file id; the
    open succeeded, the index still listed every disk block, and each was dropped on use: every
    power-acknowledged block lost without an error. Also: the refusal leaves no fd or thread
    behind and does not recreate the file."""
    state, shm = _state(tmp_path, PROMPTS)
    num_disk = _num_disk_blocks(state, shm)
    assert num_disk >= 12
    path = _disk_pool(state)
    os.unlink(path)
    with pytest.raises(TierLostError):  # once, so that lazy imports and caches are in place
        DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    before = _resources()
    with pytest.raises(TierLostError, match="forget_missing_tier") as err:
        DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    assert err.value.path == path and err.value.num_blocks == num_disk, str(err.value)
    assert path in str(err.value)
    assert not os.path.exists(path), "the refusal left a new pool file in place of the lost one"
    after = _resources()
    assert after == before, f"left behind: fds {sorted(after[0] - before[0])}, threads {sorted(after[1] - before[1])}"


def test_forget_missing_tier_drops_the_lost_blocks_counts_them_and_serves_on(tmp_path):
    """The explicit way past a lost disk pool: its blocks leave the index at recovery (counted),
    blocks still in the host pool keep serving their exact bytes, the invariants hold, and the
    next restart (without the flag) opens the new pool file and keeps what is committed since."""
    state, shm = _state(tmp_path, PROMPTS)
    num_disk = _num_disk_blocks(state, shm)
    os.unlink(_disk_pool(state))
    dc = DurableCache(state, LAYOUT, SIZES, shm_dir=shm, forget_missing_tier=True)
    try:
        assert dc.recovery["forgotten_blocks"] == num_disk
        assert dc.cache.tree.num_blocks_in[DISK] == 0
        dc.check_invariants()
        pool = StoreTokens(dc.store, BS)
        for tokens in PROMPTS:  # what the host pool (same boot) still holds is served right
            seq = dc.open(tokens)
            pool.check(seq.block_table[: seq.cached_tokens // BS], tokens[: seq.cached_tokens])
            dc.release(seq.id)
        fresh = [3001 + i for i in range(9)]
        seq = dc.open(fresh)
        pool.write(seq.block_table, fresh, seq.cached_tokens)
        dc.commit(seq.id, "power").result()
        dc.release(seq.id)
        dc.check_invariants()
    finally:
        dc.close()
    for name in os.listdir(shm):  # a reboot: only the disk pool holds blocks now
        os.unlink(os.path.join(shm, name))
    dc = DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    try:
        assert dc.recovery["forgotten_blocks"] == 0
        seq = dc.open(fresh)
        assert seq.cached_tokens == 8
        StoreTokens(dc.store, BS).check(seq.block_table[:4], fresh[:8])
        assert [dc.lookup(t).cached_tokens for t in PROMPTS] == [0, 0, 0], "a forgotten block is indexed"
        dc.check_invariants()
    finally:
        dc.close()


def test_a_missing_disk_pool_file_that_held_no_block_is_recreated(tmp_path):
    """Only a pool the index names blocks in is refused: an empty one is simply made again."""
    state, shm = _state(tmp_path, [])
    os.unlink(_disk_pool(state))
    dc = DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    try:
        assert dc.recovery["forgotten_blocks"] == 0
        dc.check_invariants()
    finally:
        dc.close()
    DurableCache(state, LAYOUT, SIZES, shm_dir=shm).close()  # its new file id was saved


def test_a_checkpoint_key_damaged_in_place_is_a_typed_corruption(tmp_path):
    """Regression (found by the bit-flip fuzz): chunk checksums cover values, not keys, so a
    flipped bit in the key ``meta`` of the checkpoint made recovery fail with a bare
    ``KeyError: b'meta'``."""
    import lmdb

    state, shm = _state(tmp_path, PROMPTS[:1])
    dc = DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
    dc.checkpoint()
    dc.close()
    env = lmdb.open(os.path.join(state, "wal"), max_dbs=8)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:
        (key,) = [k for k in txn.cursor().iternext(values=False) if k.startswith(b"meta")]
        txn.put(b"mexa" + key[4:], txn.pop(key))
    env.close()
    with pytest.raises(WalCorruptError, match="checkpoint's meta does not decode"):
        DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
