"""``prefixctl verify`` (``prefixd.tools.verify``) on the corruption tables of the crash suite:
every damage of ``test_corruption_disk``'s DISK_TABLE and ``test_corruption_lmdb``'s LMDB_TABLE,
and a missing disk pool file, is found and named; a clean state directory passes. The same
builder as those tables (``corruption_harness``: a few prompts committed at ``power``, the shm
pools deleted as after a reboot)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from prefixd.config.engine_settings import EngineConfig, TierSizes
from prefixd.tools.verify import EXIT_DAMAGED, verify
from tests.crash.corruption_harness import REPO, SIZES, build, open_cache
from tests.crash.test_corruption_disk import DISK_TABLE
from tests.crash.test_corruption_lmdb import LMDB_TABLE, build_damaged

CONFIG = EngineConfig(blocks=TierSizes(*SIZES))


def files_of(state_dir: str) -> dict[str, str]:
    """Every file's digest (the lock file aside: verify takes the lock), to prove verify
    repairs nothing: recovery would re-extend a truncated pool file and append to the log."""
    out = {}
    for root, _, names in os.walk(state_dir):
        for name in names:
            if name != "lock":
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[path] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    return out


def problems_of(state_dir: str) -> list:
    reports = verify(state_dir, CONFIG)
    assert len(reports) == 1
    return reports[0].problems


def test_verify_passes_a_clean_state_directory(tmp_path):
    """The control: nothing damaged, nothing reported (every block read and checked)."""
    b = build(tmp_path)
    reports = verify(b.state_dir, CONFIG)
    assert [r.problems for r in reports] == [[]]
    assert reports[0].checked_blocks >= sum(len(s) for s in b.slots) - 2  # shared blocks once


@pytest.mark.parametrize("row", DISK_TABLE, ids=[r.name for r in DISK_TABLE])
def test_verify_finds_every_disk_pool_damage(tmp_path, row):
    """Guards against a damaged disk pool passing verify: each row's damaged slots are named
    (or, for a header, the header)."""
    b = build(tmp_path)
    bad = row.damage(b)
    before = files_of(b.state_dir)
    problems = problems_of(b.state_dir)
    assert files_of(b.state_dir) == before, "verify changed the state directory"
    assert problems, f"verify found nothing after {row.name!r}"
    committed = {s for slots in b.slots for s in slots}
    if row.refused:
        assert any(p.what in ("disk_header", "index") and b.disk_path in p.path + p.message
                   for p in problems), problems
        return
    named = {int(p.message.split()[1].rstrip(":")) for p in problems if p.what == "disk_block"}
    assert bad & committed <= named, (bad & committed, problems)
    assert named <= bad, f"verify blamed undamaged slots {named - bad}"


@pytest.mark.parametrize("row", LMDB_TABLE, ids=[r.name for r in LMDB_TABLE])
def test_verify_finds_every_log_damage(tmp_path, row):
    """Guards against a damaged log or checkpoint passing verify."""
    b = build_damaged(tmp_path, row)
    problems = problems_of(b.state_dir)
    assert problems, f"verify found nothing after {row.name!r}"
    assert any(p.what in ("wal", "index") for p in problems), problems


def test_verify_reports_a_leaked_log_page_that_the_open_lets_through(tmp_path):
    """The open's bounds walk lets a leak through (it misdirects no read); the offline check
    runs LMDB's full verifier and names it."""
    b = build(tmp_path)
    path = os.path.join(b.state_dir, "wal", "data.mdb")
    with open(path, "r+b") as f:  # the newest meta claims one more page, in neither set
        metas = []
        for page in (0, 1):
            f.seek(page * 4096 + 136)
            metas.append(struct.unpack("<QQ", f.read(16)) + (page,))
        last_pg, _, page = max(metas, key=lambda m: m[1])
        f.seek(page * 4096 + 136)
        f.write(struct.pack("<Q", last_pg + 1))
    os.truncate(path, max(os.path.getsize(path), (last_pg + 2) * 4096))
    problems = problems_of(b.state_dir)
    assert [p.what for p in problems] == ["wal"], problems
    assert "LMDB structure" in problems[0].message and "neither reachable" in problems[0].message
    assert problems[0].path == path
    open_cache(b.state_dir, b.shm_dir).close()  # the open serves it


def test_verify_finds_a_missing_disk_pool_file(tmp_path):
    b = build(tmp_path)
    os.unlink(b.disk_path)
    problems = problems_of(b.state_dir)
    assert any("TierLost" in p.message or "disk" in p.message for p in problems), problems


def test_prefixctl_verify_json_and_exit_status(tmp_path):
    """Through the command (one run: the child imports torch): exit 1 and the two flipped
    slots in ``--json`` (exit 0 on a clean directory is the in-process control above)."""
    b = build(tmp_path)
    flipped = DISK_TABLE[4]
    assert flipped.name == "flip bits in two slots"
    flipped.damage(b)
    cmd = [sys.executable, "-m", "prefixd.client.ctl", "verify", "--state-dir", b.state_dir,
           "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    damaged = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert damaged.returncode == EXIT_DAMAGED, damaged.stderr
    doc = json.loads(damaged.stdout)
    assert doc["ok"] is False and len(doc["pools"][0]["bad_slots"]) == 2


def test_verify_progress_bar_counts_blocks(capsys):
    """The bar verify draws on a terminal (``main`` shows it only when stderr is a tty)."""
    from prefixd.tools.verify import Bar

    bar = Bar("pool 1/1")
    bar.update(3, 12)
    bar.update(12, 12)
    err = capsys.readouterr().err
    assert "\rpool 1/1 [#######" in err and "3/12 blocks" in err
    assert err.endswith("12/12 blocks\n")


def test_verify_refuses_a_directory_a_daemon_holds(tmp_path, capsys):
    """Exit 2 and what to do when the state directory is locked (verify is offline only)."""
    from prefixd.tools.verify import EXIT_UNCHECKED, main
    from prefixd.wal.lock import StateDirLock

    b = build(tmp_path)
    lock = StateDirLock(b.state_dir)
    try:
        assert main(["--state-dir", b.state_dir]) == EXIT_UNCHECKED
    finally:
        lock.release()
    assert "stop the daemon first" in capsys.readouterr().err
