"""Simulated power loss under prefixd: every commit acknowledged at ``power`` level survives.

Each run mounts a `PowerFS` (tests/crash/powerfs.py), starts the prefixd workload child
(``tests.crash.prefixd_workload`` with ``--durability power``) with its state directory on the
mount and its shm pools outside it, waits for a seeded number of acknowledged commits, stops
the child at a seeded random moment when something is unsynced, and cuts the power: the child
is SIGKILLed and everything not fsynced is dropped (``lose``) or a seeded random subset of the
unsynced 4 KiB pages is kept (``torn``). The shm pools are then deleted, because a power cut
loses shm as a reboot would, and the cache is recovered straight from the durable tree in
``fs.backing`` by `prefixd_workload.check`: every acknowledged commit must be a hit with
byte-identical KV, every block in the index must hold its prefix's bytes, invariants must hold.
Then the state is mounted again, a new child recovers it and runs on, and it is cut again: the
acks of both runs must survive (CI: 2 cuts per seed, soak: 3).

The control runs use ``--sync none`` (the WAL never fsyncs on its own) and must be caught
losing an acknowledged commit (or leaving a state that cannot be opened): that proves this
suite can see loss at all.

Workload children are forked from a forkserver that has imported the workload already (see
`_start_workload`): the same code and argv as ``python -m``, without ~2 s of imports per cut.
Skipped where FUSE is unavailable (the `powerfs` fixture).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.crash.acklog import read_acks, wait_for_acks
from tests.crash.prefixd_workload import WIDE, WIDE_SIZES, check

REPO = Path(__file__).resolve().parents[2]

CI_SEEDS = range(10)
SOAK_SEEDS = range(100, 200)
CONTROL_RUNS = tuple((mode, seed) for mode in ("lose", "torn") for seed in range(4))
LMDB_LOCK_PAGES = 1  # dirty pages the mapped LMDB lock file holds at any moment (measured)
ACKS_PER_CUT = (1, 250)  # a seeded count in this range before each cut (~300 power acks/s)


class StateLost(AssertionError):
    """The state recovered after a cut lost an acknowledged commit, served wrong bytes, or
    could not be recovered at all (the cause is chained)."""


def _wipe(shm: Path) -> None:
    """The reboot after a power cut: shared memory is gone."""
    shutil.rmtree(shm, ignore_errors=True)
    shm.mkdir(parents=True)


# The body of a forked workload child: stdout/stderr to a file, then exactly
# ``python -m tests.crash.prefixd_workload ARGV``. Passed to ``exec`` rather than defined as a
# function here because pytest imports this file under a name (``crash.test_power_loss``) that
# the forkserver's children cannot import, so a function of it cannot be pickled to them.
_CHILD_BODY = """
import os
fd = os.open(ERR_PATH, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.close(fd)
os.chdir(REPO)
from tests.crash.prefixd_workload import main
main(ARGV)
"""


def _start_workload(fs, argv: list[str], err_path: Path):
    """Start the workload child on ``fs`` (the cut SIGKILLs it).

    Children fork from a forkserver that has already imported the workload (prefixd, torch,
    numpy): a fresh ``python -m`` spends ~2 s of CPU importing torch before its first request,
    which would be most of this suite's time on 2 cores; a forked child makes its first power
    commit within ~0.1 s. The child then runs the same ``main`` with the same argv, on the same
    files, as ``python -m tests.crash.prefixd_workload``. (The forkserver process has never
    opened a cache or run a torch op, so nothing fork-unsafe is inherited.)
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.crash.prefixd_workload"])
    proc = ctx.Process(target=exec, daemon=False, args=(
        _CHILD_BODY, {"ARGV": argv, "ERR_PATH": str(err_path), "REPO": str(REPO)}))
    proc.start()
    return fs.adopt(proc)


def _wait_acks(ack_path: Path, count: int, child) -> None:
    """`wait_for_acks` for a multiprocessing child: returns early if the child died."""
    wait_for_acks(ack_path, count, timeout_s=60.0,
                  proc=SimpleNamespace(poll=lambda: child.exitcode))


def _stop_at_unsynced_moment(fs, child, rng: random.Random, *, tries: int = 100) -> bool:
    """Stop the child (SIGSTOP) at a seeded random moment when the FS holds unsynced pages.

    Tries up to `tries` moments a few milliseconds apart (resuming the child after each clean
    one); returns whether the child is stopped with unsynced pages. A moment with nothing
    unsynced is a plain ``kill -9`` (the kill -9 suite covers those): the cut has nothing to
    lose or tear. With ``sync=commit`` the unsynced pages are those of a commit in flight (disk
    blocks written but not yet fdatasync'd, LMDB pages written before its fdatasyncs); with
    ``sync=none`` they are the log's committed but never-fsynced groups. Even with
    ``sync=none``, prefixd fsyncs the log whenever it needs a slot in the allocators' quarantine
    (``Upkeep.force_release``), which with this workload's 24-block tiers happens about
    every other commit, so a cut at an arbitrary moment often finds nothing unsynced at all.
    LMDB's ``lock.mdb`` (mapped, never fsynced, so lost whole at every cut: harmless, it is
    rebuilt at open) holds `LMDB_LOCK_PAGES` dirty page all the time; it does not count.
    """
    for _ in range(tries):
        time.sleep(rng.uniform(0.0, 0.005))
        if not child.is_alive():
            return False
        os.kill(child.pid, signal.SIGSTOP)
        if fs.stats()["dirty_pages"] > LMDB_LOCK_PAGES:
            return True
        os.kill(child.pid, signal.SIGCONT)
    return False


def _stop_right_after_an_ack(fs, child, ack_path: Path, *, tries: int = 100) -> bool:
    """Control runs: stop the child within ~1 ms of an ack, at the first ack after which the FS
    holds unsynced pages. With ``sync=none`` the group holding that commit's records was
    written but not fsynced, unless a quarantine fsync (see `_stop_at_unsynced_moment`)
    happened to fall in between; stopping later makes that more likely, and then the cut has
    nothing acknowledged to lose."""
    for _ in range(tries):
        size = ack_path.stat().st_size
        deadline = time.monotonic() + 60.0
        while ack_path.stat().st_size == size:
            if not child.is_alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        os.kill(child.pid, signal.SIGSTOP)
        if fs.stats()["dirty_pages"] > LMDB_LOCK_PAGES:
            return True
        os.kill(child.pid, signal.SIGCONT)
    return False


def _power_run(powerfs, tmp_path: Path, seed: int, mode: str, *, sync: str = "commit",
               cuts: int = 1, wide: bool = False) -> dict:
    """Run the workload on a PowerFS, cut `cuts` times, recover and check after each cut.

    Each cut follows a seeded number of acks, at the first of a few seeded random moments
    (`_stop_at_unsynced_moment`) when something is unsynced, so it lands anywhere in a commit
    cycle where a power cut can actually lose or tear something. Between cuts the checked
    state is mounted again and a new child recovers it and runs on. Returns totals:
    acks checked (at the last check: every ack of every run), blocks verified, unsynced pages
    kept and lost at the cuts, cuts made with something unsynced. ``wide``: the workload's
    ``--wide`` mode (64 KiB blocks: pool files that grow and shrink by extents all along).

    Raises:
        StateLost: `check` failed after a cut (an acknowledged commit lost, wrong bytes, or a
            state that cannot be recovered); anything else is a harness or workload problem.
    """
    rng = random.Random(f"power-loss/{mode}/{sync}/{seed}")
    tag = f"{mode}-{sync}-{seed}{'-wide' if wide else ''}"
    fs = powerfs(f"fs-{tag}", seed=seed, mode=mode)
    shm, ack_path, err_path = (tmp_path / f"{what}-{tag}" for what in ("shm", "acks", "stderr"))
    _wipe(shm)
    out = {"acks": 0, "blocks": 0, "pages_kept": 0, "pages_lost": 0, "dirty_cuts": 0}
    for cut in range(cuts):
        fs.mount()
        child = _start_workload(fs, [str(fs.mnt / "state"), str(shm), str(ack_path),
                                     "--seed", str(seed + 1000 * cut), "--durability", "power",
                                     "--sync", sync, *(["--wide"] if wide else [])], err_path)
        _wait_acks(ack_path, len(read_acks(ack_path)) + rng.randint(*ACKS_PER_CUT), child)
        if sync == "none":
            out["dirty_cuts"] += _stop_right_after_an_ack(fs, child, ack_path)
        else:
            out["dirty_cuts"] += _stop_at_unsynced_moment(fs, child, rng)
        if not child.is_alive():
            raise RuntimeError(f"seed {seed} {mode}: the workload exited with {child.exitcode} "
                               f"before the cut: {err_path.read_text()[-3000:]}")
        report = fs.power_cut()
        out["pages_kept"] += report.pages_kept
        out["pages_lost"] += report.pages_lost
        _wipe(shm)
        acks = read_acks(ack_path)
        try:
            result = check(str(fs.backing / "state"), str(shm), acks, sync="commit",
                           **({"sizes": WIDE_SIZES, "layout": WIDE} if wide else {}))
        except Exception as exc:
            raise StateLost(f"cut {cut + 1} of {cuts}, {len(acks)} acks: "
                            f"{type(exc).__name__}: {exc}") from exc
        assert result["recovery"]["keep_host"] is False, "the simulated reboot kept shm residency"
        out["acks"] = result["acks"]
        out["blocks"] += result["blocks_verified"]
    return out


def _suite(powerfs, tmp_path, capsys, mode: str, seeds, *, cuts: int) -> None:
    t0 = time.monotonic()
    failures = []
    totals = {"acks": 0, "blocks": 0, "pages_kept": 0, "pages_lost": 0, "dirty_cuts": 0}
    for seed in seeds:
        try:
            got = _power_run(powerfs, tmp_path, seed, mode, cuts=cuts)
        except Exception as exc:  # keep going: report every failing seed at once
            failures.append(f"seed {seed} mode {mode}: {type(exc).__name__}: {exc}")
            continue
        for k in totals:
            totals[k] += got[k]
    with capsys.disabled():
        print(f"\npower loss [{mode}, sync=commit, {cuts} cut(s) per seed]: seeds "
              f"{seeds.start}..{seeds.stop - 1} ({len(seeds)}), {totals['acks']} acknowledged "
              f"commits checked, {totals['blocks']} blocks verified, unsynced pages at the cuts: "
              f"{totals['pages_kept']} kept / {totals['pages_lost']} lost, "
              f"{totals['dirty_cuts']} of {len(seeds) * cuts} cuts with unsynced pages, "
              f"{len(failures)} failed, {time.monotonic() - t0:.1f} s")
    assert not failures, f"acknowledged power commits lost (state kept under {tmp_path}):\n" + \
        "\n".join(failures)


@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_power_commits_survive_power_loss(powerfs, tmp_path, capsys, mode):
    """Proves: with ``sync=commit``, every commit acknowledged at ``power`` durability is a hit
    with byte-identical KV after a power cut that loses every unsynced write (``lose``) or keeps
    a random subset of unsynced 4 KiB pages (``torn``), over 10 seeds per mode, with shm lost;
    and the recovered index serves no wrong bytes."""
    _suite(powerfs, tmp_path, capsys, mode, CI_SEEDS, cuts=2)


@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_power_commits_survive_power_loss_while_pool_files_grow_and_shrink(powerfs, tmp_path, mode):
    """The same with 64 KiB blocks (``--wide``): the disk pool file grows extent by extent
    (fallocate and fsync before a slot in it is used) and the memory tiers are emptied and
    punched all along; 3 seeds, 2 cuts each."""
    for seed in range(3):
        got = _power_run(powerfs, tmp_path, 500 + seed, mode, cuts=2, wide=True)
        assert got["acks"] > 0


def test_control_sync_none_is_caught_losing_data(powerfs, tmp_path, capsys):
    """Proves the harness can see loss: with ``sync=none`` (the WAL fsyncs only when the
    quarantine needs it) the same workload and check catch at least one of 8 runs (4 seeds per
    mode, each cut right after an ack) losing an acknowledged commit or leaving a state that
    cannot be recovered. If this fails, the power-loss tests above prove nothing."""
    caught = []
    for mode, seed in CONTROL_RUNS:
        try:
            got = _power_run(powerfs, tmp_path, seed, mode, sync="none")
        except StateLost as exc:  # not a harness error: only what `check` found after a cut
            caught.append((mode, seed, f"{type(exc.__cause__).__name__}: {str(exc)[:200]}"))
            continue
        with capsys.disabled():
            print(f"\ncontrol sync=none {mode} seed {seed}: not caught "
                  f"({got['acks']} acks held, {got['pages_lost']} pages lost)")
    with capsys.disabled():
        for mode, seed, why in caught:
            print(f"\ncontrol sync=none {mode} seed {seed}: caught: {why}")
        print(f"\ncontrol sync=none: {len(caught)} of {len(CONTROL_RUNS)} runs caught losing data")
    assert caught, "sync=none lost nothing acknowledged in any run: the harness cannot see loss"


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_power_commits_survive_power_loss_soak(powerfs, tmp_path, capsys, mode):
    """Proves the same as `test_power_commits_survive_power_loss` over 100 more seeds per mode,
    with three cuts per seed (each next child recovers the previous cut's durable state, runs
    on, and is cut again; every commit acknowledged in any run must survive)."""
    _suite(powerfs, tmp_path, capsys, mode, SOAK_SEEDS, cuts=3)
