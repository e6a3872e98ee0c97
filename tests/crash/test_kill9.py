"""``kill -9`` under load, and named crash points: nothing acknowledged is lost.

A child process runs ``tests.crash.prefixd_workload`` (random opens, extends, forks, commits
at ``crash`` durability, evictions across three small tiers, checkpoints) and logs each commit
after it was acknowledged. The parent kills it (SIGKILL at a random moment, or the child dies at
a named crash point), recovers the state directory and checks that every acknowledged commit is
a hit on all its blocks with byte-identical KV, that every block in the index holds exactly the
bytes its prefix implies, and that the invariants hold. The same state directory is reused
across kills, so each child also starts by recovering the previous crash.
"""

import os
import random
import signal
import time

import pytest

from prefixd.crashpoints import CRASH_EXIT_CODE
from tests.crash.acklog import read_acks, wait_for_acks
from tests.crash.prefixd_workload import CONCURRENT_SIZES, SIZES, WIDE, WIDE_SIZES, check
from tests.crash.workload_zygote import WorkloadZygote


@pytest.fixture(scope="module")
def zygote():
    """Every workload child of this module is a fork of one zygote (``workload_zygote``)."""
    z = WorkloadZygote()
    yield z
    z.close()


def _spawn(zygote, tmp_path, seed, *extra, env_extra=None):
    return zygote.spawn([tmp_path / "state", tmp_path / "shm", tmp_path / "acks", "--seed", seed, *extra],
                        tmp_path / f"stderr-{seed}", env_extra)


def _kill_cycles(zygote, tmp_path, kills: int, seed: int, *extra, sizes=SIZES, layout=None) -> dict:
    os.makedirs(tmp_path / "shm", exist_ok=True)
    rng = random.Random(seed)
    totals = {"kills": 0, "acks": 0, "blocks_verified": 0}
    for i in range(kills):
        before = len(read_acks(tmp_path / "acks"))
        child = _spawn(zygote, tmp_path, seed * 1000 + i, *extra)
        try:
            wait_for_acks(tmp_path / "acks", before + rng.randint(1, 25), timeout_s=60, proc=child)
            time.sleep(rng.random() * 0.05)
        finally:
            child.send_signal(signal.SIGKILL)
            _, err = child.communicate()
        assert child.returncode == -signal.SIGKILL, err.decode()[-2000:]
        result = check(str(tmp_path / "state"), str(tmp_path / "shm"), read_acks(tmp_path / "acks"),
                       sizes=sizes, **({} if layout is None else {"layout": layout}))
        totals["kills"] += 1
        totals["acks"] = result["acks"]
        totals["blocks_verified"] += result["blocks_verified"]
    return totals


def test_kill_9_under_load_loses_nothing_acknowledged(zygote, tmp_path, capsys):
    totals = _kill_cycles(zygote, tmp_path, kills=20, seed=1)
    with capsys.disabled():
        print(f"\nkill -9: {totals['kills']} kills, {totals['acks']} acknowledged commits checked, "
              f"{totals['blocks_verified']} blocks verified byte for byte")
    assert totals["acks"] > 20


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_kill_9_under_load_loses_nothing_acknowledged_soak(zygote, tmp_path, capsys):
    totals = _kill_cycles(zygote, tmp_path, kills=200, seed=2)
    with capsys.disabled():
        print(f"\nkill -9 soak: {totals}")


def test_the_kill_9_harness_catches_an_acknowledgement_before_commit(zygote, tmp_path):
    """Control: a planted bug (ack before the WAL commit) must be caught losing data."""
    caught = False
    for attempt in range(8):
        d = tmp_path / f"a{attempt}"
        os.makedirs(d / "shm")
        child = _spawn(zygote, d, attempt, "--plant", "ack-before-commit")
        try:
            wait_for_acks(d / "acks", 3 + attempt, timeout_s=60, proc=child)
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate()
        try:
            check(str(d / "state"), str(d / "shm"), read_acks(d / "acks"))
        except AssertionError:
            caught = True
            break
    assert caught, "the harness did not see a lost acknowledged commit: it cannot detect loss"


def test_kill_9_with_16_sequences_committing_concurrently_loses_nothing_acknowledged(zygote, tmp_path, capsys):
    """Commits through tickets, 16 sequences in flight on one thread (as the daemon will run
    the engine): each acknowledged only when its ticket resolved."""
    totals = _kill_cycles(zygote, tmp_path, 3, 3, "--concurrent", "16", sizes=CONCURRENT_SIZES)
    with capsys.disabled():
        print(f"\nkill -9, 16 concurrent: {totals}")
    assert totals["acks"] > 3


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_kill_9_with_16_sequences_committing_concurrently_soak(zygote, tmp_path, capsys):
    totals = _kill_cycles(zygote, tmp_path, 100, 4, "--concurrent", "16", sizes=CONCURRENT_SIZES)
    with capsys.disabled():
        print(f"\nkill -9 soak, 16 concurrent: {totals}")


@pytest.mark.parametrize("durability", ["crash", "power"])
def test_the_concurrent_kill_9_mode_catches_an_acknowledgement_before_its_ticket(zygote, tmp_path, durability):
    """Control: acknowledging a commit when ``commit`` returns, before its ticket resolves,
    must be caught losing data (so the concurrent mode can see a ticket acknowledged early)."""
    for attempt in range(8):
        d = tmp_path / f"a{attempt}"
        os.makedirs(d / "shm")
        child = _spawn(zygote, d, attempt, "--concurrent", "16", "--durability", durability,
                       "--plant", "ack-before-ticket")
        try:
            wait_for_acks(d / "acks", 20 + 10 * attempt, timeout_s=60, proc=child)
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate()
        try:
            check(str(d / "state"), str(d / "shm"), read_acks(d / "acks"), sizes=CONCURRENT_SIZES)
        except AssertionError as exc:
            assert "acknowledged commit lost" in str(exc), exc  # loss, not some other damage
            return
    raise AssertionError("the concurrent mode did not see an acknowledgement given before its "
                         "ticket resolved lose data: it cannot detect loss")


CRASH_POINTS = ["disk_data_written", "disk_data_synced", "commit_data_written", "commit_data_synced",
                "checkpoint_dumped", "wal_checkpoint_inside", "wal_before_commit", "wal_after_commit",
                "evict_inside", "promote_inside"]


def _crash_at(zygote, tmp_path, point: str, n: int) -> dict:
    os.makedirs(tmp_path / "shm", exist_ok=True)
    # enough requests to reach the n-th of the rarest point: 3,000 made 85-89 checkpoints, and
    # the soak's n=90 at checkpoint_dumped ran out of requests (exit 0)
    requests = max(3000, 60 * n)
    child = _spawn(zygote, tmp_path, n, "--requests", str(requests), env_extra={"PREFIXD_CRASH": f"{point}:{n}"})
    _, err = child.communicate(timeout=120)
    assert child.returncode == CRASH_EXIT_CODE, \
        f"crash point {point}:{n} was not reached (exit {child.returncode}): {err.decode()[-1500:]}"
    return check(str(tmp_path / "state"), str(tmp_path / "shm"), read_acks(tmp_path / "acks"))


# the grow and the punch of a sparse pool file's extents, in the ``--wide`` workload (whose
# files grow and shrink all along); the same points at the file level: test_extents_kill9.py
EXTENT_POINTS = ["extent_grown", "extent_punched"]
SLACK = 64 * 1024  # a filesystem's own metadata blocks count in st_blocks too


@pytest.mark.parametrize("point", EXTENT_POINTS)
@pytest.mark.parametrize("n", [1, 9])
def test_a_crash_growing_or_punching_an_extent_loses_nothing_acknowledged(zygote, tmp_path, point, n):
    """Twice on one state directory: the second child recovers the first one's crash, runs
    and crashes again; each time every acknowledged commit is a hit with its bytes, and each
    pool file takes what its ledger was charged (idle extents punched at recovery)."""
    os.makedirs(tmp_path / "shm", exist_ok=True)
    for run in range(2):
        child = _spawn(zygote, tmp_path, run, "--wide", "--requests", "1000",
                       env_extra={"PREFIXD_CRASH": f"{point}:{n}"})
        _, err = child.communicate(timeout=120)
        assert child.returncode == CRASH_EXIT_CODE, \
            f"crash point {point}:{n} was not reached (exit {child.returncode}): {err.decode()[-1500:]}"
        result = check(str(tmp_path / "state"), str(tmp_path / "shm"), read_acks(tmp_path / "acks"),
                       sizes=WIDE_SIZES, layout=WIDE)
        for tier, taken in result["taken"].items():
            assert result["charged"][tier] <= taken <= result["charged"][tier] + SLACK, (tier, result)
    assert result["acks"] > 0


def test_kill_9_under_load_with_growing_and_shrinking_files_loses_nothing(zygote, tmp_path, capsys):
    totals = _kill_cycles(zygote, tmp_path, 6, 7, "--wide", sizes=WIDE_SIZES, layout=WIDE)
    with capsys.disabled():
        print(f"\nkill -9, growing and shrinking files: {totals}")
    assert totals["acks"] > 6


@pytest.mark.parametrize("point", CRASH_POINTS)
@pytest.mark.parametrize("n", [1, 9])
def test_a_crash_at_a_named_point_loses_nothing_acknowledged(zygote, tmp_path, point, n):
    result = _crash_at(zygote, tmp_path, point, n)
    assert result["recovery"]["ready_s"] > 0


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("point", CRASH_POINTS)
@pytest.mark.parametrize("n", [2, 5, 17, 40, 90])
def test_a_crash_at_a_named_point_loses_nothing_acknowledged_soak(zygote, tmp_path, point, n):
    _crash_at(zygote, tmp_path, point, n)
