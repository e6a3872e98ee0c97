"""Corruption table of the log's LMDB file: damage a closed state directory, recover it, check the
outcome.

One harness (``corruption_harness``), one table per file kind, as etcd's WAL tests do; this is
the table of the LMDB file (``<state_dir>/wal/data.mdb``; ``test_corruption_disk`` holds the disk
pool's). Every row damages a freshly built state directory (a few prompts committed at
``power``, optionally folded into a checkpoint first) and states the one outcome its recovery
must give: a typed error (class named, message matched) or a clean recovery whose every served
byte is right. Records are found by searching the file for the committed token bytes, and every
copy is damaged (LMDB copies a page on write, so freed pages hold stale copies of live records).

Recovery runs away from pytest, since a damaged LMDB may SIGSEGV/SIGBUS its reader
(``recovery_driver``):

    python -m tests.crash.test_corruption_lmdb recover '{"row name": [STATE_DIR, SHM_DIR], ...}'

recovers each directory in its own forked child (one interpreter start for the whole table) and
prints one JSON line mapping each row to ``{"error": "module.Class", "message": ...}``,
``{"served": [blocks per prompt]}`` or ``{"died": exit code, "stderr": ...}``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from prefixd.wal.datafile import newest_meta
from tests.crash.corruption_harness import (PAGE, PROMPTS, Built, build, flip_token_bits, open_cache,
                                           serve_all, token_offsets)
from tests.crash.recovery_driver import recover_in_child, run_driver

# -- damage to the LMDB file ----------------------------------------------------------------------------

def _mdb(b: Built) -> str:
    return os.path.join(b.state_dir, "wal", "data.mdb")


def lmdb_flip_bits_in_records(b: Built) -> None:
    flip_token_bits(_mdb(b), PROMPTS[0])


def lmdb_zero_record_pages(b: Built) -> None:
    path = _mdb(b)
    data = bytearray(Path(path).read_bytes())
    for off in token_offsets(data, PROMPTS[0]):
        start = off // PAGE * PAGE
        data[start:start + PAGE] = bytes(PAGE)
    Path(path).write_bytes(data)


def lmdb_truncate_past_the_meta_pages(b: Built) -> None:
    """Cut half the pages in use (not of the file: an open pads it past its last page)."""
    path = _mdb(b)
    _, last_pg, psize = newest_meta(path)
    used = (last_pg + 1) * psize
    assert used > 4 * PAGE
    os.truncate(path, used // PAGE // 2 * PAGE)


def lmdb_truncate_inside_the_meta_pages(b: Built) -> None:
    os.truncate(_mdb(b), PAGE)


def lmdb_truncate_to_zero(b: Built) -> None:
    os.truncate(_mdb(b), 0)


class LmdbDamage(NamedTuple):
    name: str
    damage: Callable[[Built], None]
    checkpoint: bool  # fold the log into a checkpoint first: the tokens then live in ``index``
    outcome: str  # "ok" (clean recovery), else the error class the child must report
    message: str = ""  # regex the error message must match


WAL_CORRUPT = "prefixd.wal.errors.WalCorruptError"

LMDB_TABLE = [
    LmdbDamage("flip bits in a log record", lmdb_flip_bits_in_records, False, WAL_CORRUPT,
               r"lsn \d+ in .*: checksum mismatch"),
    LmdbDamage("flip bits in a checkpoint chunk", lmdb_flip_bits_in_records, True, WAL_CORRUPT,
               r"checkpoint key .* checksum mismatch"),
    LmdbDamage("zero the page of a log record", lmdb_zero_record_pages, False, WAL_CORRUPT,
               r"damaged LMDB page.*structural check"),
    LmdbDamage("zero the page of a checkpoint chunk", lmdb_zero_record_pages, True, WAL_CORRUPT,
               r"damaged LMDB page.*structural check"),
    LmdbDamage("truncate past the meta pages", lmdb_truncate_past_the_meta_pages, False, WAL_CORRUPT,
               r"data\.mdb is \d+ bytes"),
    LmdbDamage("truncate past the meta pages, checkpointed", lmdb_truncate_past_the_meta_pages, True,
               WAL_CORRUPT, r"data\.mdb is \d+ bytes"),
    LmdbDamage("truncate inside the meta pages", lmdb_truncate_inside_the_meta_pages, False, WAL_CORRUPT,
               r"data\.mdb is 4096 bytes"),
    # An empty data.mdb is what LMDB creates for a new directory: starting a new cache there
    # would leave the old disk pool unseen on disk, so recovery refuses and says what to do.
    LmdbDamage("truncate to zero", lmdb_truncate_to_zero, False,
               "prefixd.engine.errors.IndexLostError", r"has disk pool\(s\) prefixd-.*\.disk\.pool but no index"),
]


def build_damaged(root: Path, row: LmdbDamage) -> Built:
    """The harness's state directory under `root`, checkpointed if the row says so, damaged."""
    b = build(root)
    if row.checkpoint:
        dc = open_cache(b.state_dir, b.shm_dir)
        dc.checkpoint()
        dc.close()
    row.damage(b)
    return b


@pytest.fixture(scope="module")
def lmdb_outcomes(tmp_path_factory) -> dict[str, dict]:
    """Every LMDB row, damaged and recovered in one driver (one interpreter start for the table):
    row name -> what its recovery reported, or ``{"died": rc}``."""
    dirs = {row.name: build_damaged(tmp_path_factory.mktemp("lmdb"), row) for row in LMDB_TABLE}
    got = run_driver("tests.crash.test_corruption_lmdb",
                     ["recover", json.dumps({name: [b.state_dir, b.shm_dir] for name, b in dirs.items()})],
                     timeout_s=300)
    return {name: dict(got[name], slots=dirs[name].slots) for name in dirs}


@pytest.mark.parametrize("row", LMDB_TABLE, ids=[r.name for r in LMDB_TABLE])
def test_damaged_lmdb_is_refused_with_a_typed_error_or_serves_only_right_bytes(lmdb_outcomes, row):
    """Guards against a damaged log being replayed into a wrong index (wrong bytes served), and
    against a recovery that dies of a signal (SIGBUS on a truncated data.mdb) or of an untyped
    error instead of saying what is wrong."""
    got = lmdb_outcomes[row.name]
    assert "died" not in got, f"recovery died: rc={got['died']} (negative: signal) {got.get('stderr', '')}"
    if row.outcome == "ok":
        assert "served" in got, got
        assert all(n <= len(s) for n, s in zip(got["served"], got["slots"])), got
    else:
        assert got.get("error") == row.outcome, got
        assert re.search(row.message, got["message"]), got


# -- the driver (runs in its own interpreter) -------------------------------------------------------

def _recover_one(state_dir: str, shm_dir: str) -> dict:
    """Recover; the typed error, or (after checking every served byte) the blocks served."""
    from tests.crash.prefixd_workload import verify_index

    try:
        dc = open_cache(state_dir, shm_dir)
    except Exception as exc:  # noqa: BLE001 - the parent asserts which type
        kind = type(exc)
        return {"error": f"{kind.__module__}.{kind.__name__}", "message": str(exc)}
    try:
        verify_index(dc)
        served = serve_all(dc)
        verify_index(dc)
        dc.check_invariants()
    finally:
        dc.close()
    return {"served": served}


def _recover_main(dirs: dict[str, list[str]]) -> None:
    """Recover each state dir in a forked child, so that a signal kills only that one."""
    results = {name: recover_in_child(partial(_recover_one, state_dir, shm_dir), os.path.dirname(state_dir))
               for name, (state_dir, shm_dir) in dirs.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:2] != ["recover"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tests.crash.test_corruption_lmdb recover '{\"row\": [STATE_DIR, SHM_DIR]}'")
    _recover_main(json.loads(sys.argv[2]))
