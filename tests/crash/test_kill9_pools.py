"""``kill -9`` of an engine serving four pools (two tenants x two KV layouts) in one state dir:
each pool recovers exactly its own blocks.

A child runs ``tests.crash.pools_workload`` (commits in every pool, pool-specific KV bytes, the
same prompts in several pools) and logs each acknowledged commit; the parent SIGKILLs it at a
random moment, reopens the ``Engine`` and checks each pool against its own acknowledgements and
bytes, and that no pool holds or hits another's prompts. The state directory is reused across
kills, so each child also recovers the previous crash. Planted routing bugs show the check
catches a pool that holds another pool's blocks.
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.crash.acklog import read_acks, wait_for_acks
from tests.crash.pools_workload import POOLS, check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(d, seed, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PREFIXD_CRASH", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.crash.pools_workload", str(d / "state"), str(d / "shm"),
         str(d / "acks"), "--seed", str(seed), *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_once(d, seed: int, min_acks: int, *extra) -> None:
    os.makedirs(d / "shm", exist_ok=True)
    child = _spawn(d, seed, *extra)
    try:
        wait_for_acks(d / "acks", min_acks, timeout_s=90, proc=child)
        time.sleep(random.Random(seed).random() * 0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err.decode()[-2000:]


def _kill_cycles(d, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    totals = {"kills": 0, "acks": 0, "blocks_verified": 0}
    for i in range(kills):
        before = len(read_acks(d / "acks"))
        _kill_once(d, seed * 1000 + i, before + rng.randint(15, 40))
        result = check(str(d / "state"), str(d / "shm"), read_acks(d / "acks"))
        totals["kills"] += 1
        totals["acks"] = result["acks"]
        totals["blocks_verified"] += result["blocks_verified"]
        totals["blocks"] = result["blocks"]
    return totals


def test_kill_9_of_four_pools_recovers_each_pool_exactly_its_own_blocks(tmp_path, capsys):
    totals = _kill_cycles(tmp_path, kills=2, seed=1)
    with capsys.disabled():
        print(f"\nkill -9, {len(POOLS)} pools: {totals}")
    assert totals["acks"] > 25
    assert all(sum(blocks) for blocks in totals["blocks"]), "a pool was never written"


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_kill_9_of_four_pools_recovers_each_pool_exactly_its_own_blocks_soak(tmp_path, capsys):
    totals = _kill_cycles(tmp_path, kills=40, seed=2)
    with capsys.disabled():
        print(f"\nkill -9 soak, {len(POOLS)} pools: {totals}")


@pytest.mark.parametrize("plant, words", [
    ("cross-pool", "holds a block of pool|acknowledged commit lost"),  # whichever pool is checked first
    ("shared-bytes", "wrong bytes"),
])
def test_the_pools_check_catches_a_pool_that_serves_another_pools_blocks(tmp_path, plant, words):
    """Control: a request served in the wrong pool, or pools sharing bytes, must be caught."""
    _kill_once(tmp_path, 7, 30, "--plant", plant)
    with pytest.raises(AssertionError, match=words):
        check(str(tmp_path / "state"), str(tmp_path / "shm"), read_acks(tmp_path / "acks"))
