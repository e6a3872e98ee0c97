"""Sparse pool files under power cuts (PowerFS: what was not fsynced is lost, or torn at page
granularity): the grow's fallocate + fsync before a slot is used, data before its record, and
free before punch keep every logged block whole, and recovery charges what the file holds."""

import sys
import time

import pytest

from tests.crash.extents_workload import check, puts_logged

SLACK = 16 * 1024
CONTROL_CUTS = 10


def _cut_runs(fs, cuts: int, *extra: str):
    """``cuts`` runs of the workload on ``fs``, each cut after 30 more logged blocks and
    checked; yields each check's result."""
    for cut in range(cuts):                 # each run first recovers the previous cut
        fs.mount()
        state = fs.mnt / "state"
        state.mkdir(exist_ok=True)
        child = fs.spawn([sys.executable, "-m", "tests.crash.extents_workload", str(state),
                          "--rounds", "1000000", "--seed", str(cut), *extra])
        deadline = time.monotonic() + 120
        start = puts_logged(str(state))
        while puts_logged(str(state)) < start + 30:
            assert child.poll() is None, f"the workload exited with {child.returncode}"
            assert time.monotonic() < deadline, "the workload logged fewer than 30 blocks in 120 s"
            time.sleep(0.05)
        fs.power_cut()
        yield check(str(fs.backing / "state"))


@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_a_power_cut_loses_no_logged_block_of_a_growing_and_shrinking_file(powerfs, mode):
    for result in _cut_runs(powerfs(f"fs-{mode}", seed=11, mode=mode), 3):
        assert result["wrong"] == 0, result
        assert result["charged"] <= result["held"] <= result["charged"] + SLACK, result
    assert result["live"] > 0


def test_control_blocks_logged_before_their_bytes_are_synced_are_caught_lost(powerfs):
    """Proves the harness sees loss on a sparse file: the same workload logging blocks
    without syncing their bytes first loses some at a cut that drops unsynced pages.

    A loss needs the cut to fall between a record's fsync and the next grow's fsync of the
    pool file (which syncs the earlier bytes too); on a loaded host fewer cuts land there, so
    the control cuts until it sees a loss, up to ``CONTROL_CUTS``."""
    wrong = []
    for result in _cut_runs(powerfs("fs-control", seed=3, mode="lose"), CONTROL_CUTS,
                            "--no-data-sync"):
        wrong.append(result["wrong"])
        if result["wrong"]:
            break
    assert sum(wrong) > 0, f"no loss seen in {len(wrong)} cuts: {wrong}"
