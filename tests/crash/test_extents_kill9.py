"""Sparse pool files under crashes: a child grows, writes, frees and shrinks one file under
the engine's write order (``tests.crash.extents_workload``) and dies at a named crash point in
the grow or the shrink, or of SIGKILL at a random moment; recovery (``recover`` with the slots
its log names) finds every logged block with its bytes, and charges what the file takes."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from prefixd.crashpoints import CRASH_EXIT_CODE
from tests.crash.extents_workload import check, puts_logged

CRASH_POINTS = ["extent_grown", "extent_punched"]
SLACK = 16 * 1024  # ext4's extent tree blocks count in st_blocks too


def _spawn(directory, *args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "tests.crash.extents_workload", str(directory), *args],
                            env=env, stderr=subprocess.PIPE)


def _assert_recovered(directory):
    result = check(str(directory))
    assert result["wrong"] == 0, result
    assert result["charged"] <= result["held"] <= result["charged"] + SLACK, result
    return result


@pytest.mark.parametrize("point", CRASH_POINTS)
@pytest.mark.parametrize("n", [1, 9])
def test_a_crash_in_a_grow_or_a_shrink_loses_no_logged_block(tmp_path, point, n):
    for seed in range(2):          # the second child first recovers the first one's crash
        child = _spawn(tmp_path, "--seed", str(seed), env_extra={"PREFIXD_CRASH": f"{point}:{n}"})
        _, err = child.communicate(timeout=120)
        assert child.returncode == CRASH_EXIT_CODE, \
            f"crash point {point}:{n} was not reached (exit {child.returncode}): {err.decode()[-1500:]}"
        result = _assert_recovered(tmp_path)
    assert result["live"] > 0


def test_kill9_at_random_moments_loses_no_logged_block(tmp_path):
    rng = random.Random(5)
    for seed in range(4):
        child = _spawn(tmp_path, "--seed", str(seed), "--rounds", "100000")
        deadline, start = time.monotonic() + 60, puts_logged(str(tmp_path))
        while puts_logged(str(tmp_path)) < start + 20:
            assert child.poll() is None, f"the workload exited with {child.returncode}"
            assert time.monotonic() < deadline, "the workload logged fewer than 20 blocks in 60 s"
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.2))
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL, "the child ended before it was killed"
        _assert_recovered(tmp_path)
