"""Corruption table: damage a closed state directory, reopen it, check what is served.

One harness, one TABLE per file kind (as etcd's WAL tests do). Every row names the file and the
damage; the harness builds the same state directory in-process (a few prompts committed at
``power``, shm pools deleted afterwards as after a reboot, so the disk tier is the only copy of
the KV bytes), closes it, applies the row's damage, reopens and checks the contract:

Disk tier file (``<state_dir>/*.disk.pool``), in-process, ``verify="lazy"`` and ``"eager"``:
    a block whose bytes were damaged is never served (``open`` cuts the match before it, and
    before everything below it on disk); every undamaged block keeps serving with the right
    bytes; ``stats.corrupt_blocks`` is non-zero exactly when a damaged block was met. NOTE: the
    counter counts detections (one per run cut), not blocks: the run's tail and its subtree are
    dropped unread. With ``lazy``, ``lookup`` is an index query and may still count a damaged
    block until the first ``open`` that reads it; with ``eager`` it never does. A damaged
    header is REFUSED at open (``HeaderMismatchError`` naming the file), except truncation into
    the header's zero padding, which leaves every field intact and is handled like any
    truncation (the file is re-extended; the lost slots fail their checksums).

LMDB file (``<state_dir>/wal/data.mdb``), recovered in a child process (a damaged LMDB may
SIGSEGV/SIGBUS its reader, which must not kill pytest): each row states the one outcome seen,
either a typed error (class named) or a clean recovery whose every served byte is right.
Records are found by searching the file for the committed token bytes, and every copy is damaged
(LMDB copies a page on write, so freed pages hold stale copies of live records).

    python -m tests.crash.test_corruption recover '{"row name": [STATE_DIR, SHM_DIR], ...}'
recovers each directory in its own forked child (one interpreter start for the whole table) and
prints one JSON line mapping each row to ``{"error": "module.Class", "message": ...}``,
``{"served": [blocks per prompt]}`` or ``{"died": exit code, "stderr": ...}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest

from prefixd.api.layout import KVLayout
from prefixd.engine.durable import DurableCache
from prefixd.cache.node import DISK, path_to
from prefixd.wal.datafile import newest_meta
from prefixd.storage.errors import HeaderMismatchError
from prefixd.storage.poolfile import DATA_OFFSET
from tests.cache.helpers import StoreTokens

REPO = Path(__file__).resolve().parents[2]
BS = 4
# 8 KiB blocks (2 layers x K/V x 4 tokens x 2 heads x 64 dims x fp32): a 4 KiB page lies inside a slot
LAYOUT = KVLayout("corruption-test", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=BS)
SIZES = (64, 16, 64)
PAGE = 4096
BASE = 7_000_000  # token ids: their int32 bytes are searched for in the LMDB file


def _prompts() -> list[list[int]]:
    """Four unrelated prompts of 3 whole blocks (+1 token), and one that shares two blocks of the
    second (so damage there must also cut the sharer)."""
    out = [[BASE + 1000 * p + i for i in range(3 * BS + 1)] for p in range(4)]
    out.append(out[1][: 2 * BS] + [BASE + 9000 + i for i in range(2 * BS + 1)])
    return out


PROMPTS = _prompts()


class Built(NamedTuple):
    state_dir: str
    shm_dir: str
    disk_path: str
    block_bytes: int
    slots: list[list[int]]  # per prompt: the disk slot of each whole block, in order

    def offset(self, slot: int) -> int:
        return DATA_OFFSET + slot * self.block_bytes


def open_cache(state_dir: str, shm_dir: str, **kw) -> DurableCache:
    return DurableCache(state_dir, LAYOUT, SIZES, shm_dir=shm_dir, reclaim_grace_s=0.0, **kw)


def _disk_slots(dc: DurableCache, tokens: list[int]) -> list[int]:
    """The disk slot of each whole block of ``tokens`` (read off the tree)."""
    want = np.asarray(tokens, "<i4").tobytes()
    by_block: dict[int, int] = {}
    for node in dc.cache.tree.nodes():
        prefix = b"".join(n.tokens for n in path_to(node))
        if node.slots[DISK] is None or not want.startswith(prefix):
            continue
        first = len(prefix) // (4 * BS) - node.num_blocks
        for k, slot in enumerate(node.slots[DISK]):
            by_block[first + k] = slot
    n = (len(tokens) - 1) // BS
    assert sorted(by_block) == list(range(n)), f"prompt not wholly on disk: {by_block}"
    return [by_block[b] for b in range(n)]


def build(root: Path) -> Built:
    """Commit every prompt at ``power``, close, and drop the shm pools (as after a reboot)."""
    state, shm = root / "state", root / "shm"
    shm.mkdir(parents=True)
    dc = open_cache(str(state), str(shm))
    try:
        pool = StoreTokens(dc.store, BS)
        for tokens in PROMPTS:
            seq = dc.open(tokens)
            pool.write(seq.block_table, tokens, seq.cached_tokens)
            dc.commit(seq.id, "power").result()
            dc.release(seq.id)
        slots = [_disk_slots(dc, t) for t in PROMPTS]
        disk = dc.store.pool(DISK)
        built = Built(str(state), str(shm), disk.path, disk.block_bytes, slots)
    finally:
        dc.close()
    for name in os.listdir(shm):
        os.unlink(shm / name)
    assert all(v % (1 << 20) for t in PROMPTS for v in StoreTokens.values(t)), "a zero value hides damage"
    return built


# -- damage to the disk tier file -------------------------------------------------------------------
# Each function damages the closed pool file and returns the slots whose bytes it changed.

def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def _write(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path: str, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def truncate_mid_slot(b: Built) -> set[int]:
    slot = b.slots[1][1]
    _truncate(b.disk_path, b.offset(slot) + b.block_bytes // 2 + 100)
    return set(range(slot, SIZES[2]))


def truncate_to_header(b: Built) -> set[int]:
    _truncate(b.disk_path, DATA_OFFSET)
    return set(range(SIZES[2]))


def truncate_in_header_padding(b: Built) -> set[int]:
    _truncate(b.disk_path, 2048)  # every header field and its hash lie in the first ~200 bytes
    return set(range(SIZES[2]))


def zero_page_in_slot(b: Built) -> set[int]:
    slot = b.slots[2][0]
    _write(b.disk_path, b.offset(slot) + PAGE, bytes(PAGE))  # the second 4 KiB of the 8 KiB slot
    return {slot}


def flip_bits_in_slots(b: Built) -> set[int]:
    bad = {b.slots[0][2], b.slots[3][1]}
    for slot in bad:
        _flip(b.disk_path, b.offset(slot) + 1234)
        _flip(b.disk_path, b.offset(slot) + 5000, 0x01)
    return bad


def flip_bit_in_shared_block(b: Built) -> set[int]:
    slot = b.slots[1][0]  # shared by prompts 1 and 4: both lose everything from it on
    _flip(b.disk_path, b.offset(slot) + b.block_bytes - 1, 0x80)
    return {slot}


def flip_bit_in_header_field(b: Built) -> set[int]:
    _flip(b.disk_path, 30)  # inside num_slots / block_bytes: caught by the header hash
    return set()


def zero_header_page(b: Built) -> set[int]:
    _write(b.disk_path, 0, bytes(PAGE))
    return set()


def truncate_in_header_fields(b: Built) -> set[int]:
    _truncate(b.disk_path, 70)  # past the fixed fields, inside the layout bytes
    return set()


class DiskDamage(NamedTuple):
    name: str
    damage: Callable[[Built], set[int]]
    refused: str | None = None  # regex the HeaderMismatchError must match (after the path)


DISK_TABLE = [
    DiskDamage("truncate mid-slot", truncate_mid_slot),
    DiskDamage("truncate to the header", truncate_to_header),
    DiskDamage("truncate inside the header padding", truncate_in_header_padding),
    DiskDamage("zero a 4 KiB page inside a slot", zero_page_in_slot),
    DiskDamage("flip bits in two slots", flip_bits_in_slots),
    DiskDamage("flip a bit in a shared block", flip_bit_in_shared_block),
    DiskDamage("flip a bit in a header field", flip_bit_in_header_field, "checksum does not match"),
    DiskDamage("zero the header page", zero_header_page, "bad magic"),
    DiskDamage("truncate inside the header fields", truncate_in_header_fields, "truncated"),
]


def _expected_blocks(b: Built, bad: set[int]) -> list[int]:
    """Per prompt: whole blocks served = those before its first damaged block."""
    out = []
    for slots in b.slots:
        out.append(next((k for k, s in enumerate(slots) if s in bad), len(slots)))
    return out


def _serve_all(dc: DurableCache) -> list[int]:
    """Open every prompt; check the bytes of every block served; returns blocks served each."""
    pool = StoreTokens(dc.store, BS)
    served = []
    for tokens in PROMPTS:
        seq = dc.open(tokens)
        n = seq.cached_tokens // BS
        pool.check(seq.block_table[:n], tokens[: n * BS])
        dc.release(seq.id)
        served.append(n)
    return served


@pytest.mark.parametrize("verify", ["lazy", "eager"])
@pytest.mark.parametrize("row", DISK_TABLE, ids=[r.name for r in DISK_TABLE])
def test_damaged_disk_blocks_are_never_served_and_the_rest_keeps_serving(tmp_path, row, verify):
    """Guards against serving bytes from a damaged disk slot (or from below one), against losing
    undamaged prompts with it, and against a damaged pool header being trusted or refused without
    naming the file."""
    from tests.crash.prefixd_workload import verify_index

    b = build(tmp_path)
    bad = row.damage(b)
    if row.refused:
        with pytest.raises(HeaderMismatchError, match=row.refused) as err:
            open_cache(b.state_dir, b.shm_dir, verify=verify)
        assert b.disk_path in str(err.value), f"the refusal does not name the file: {err.value}"
        return
    want = _expected_blocks(b, bad)
    assert any(w < len(s) for w, s in zip(want, b.slots)), "the row damaged no committed block"
    dc = open_cache(b.state_dir, b.shm_dir, verify=verify)
    try:
        assert dc.recovery["keep_host"] is False
        if verify == "eager":
            assert [dc.lookup(t).cached_tokens // BS for t in PROMPTS] == want
            assert dc.cache.stats.corrupt_blocks >= 1
        assert _serve_all(dc) == want
        assert dc.cache.stats.corrupt_blocks >= 1
        assert [dc.lookup(t).cached_tokens // BS for t in PROMPTS] == want
        verify_index(dc)
        dc.check_invariants()
    finally:
        dc.close()
    dc = open_cache(b.state_dir, b.shm_dir, verify=verify)  # the cut was logged: it stays cut
    try:
        assert _serve_all(dc) == want
        assert dc.cache.stats.corrupt_blocks == 0, "a block cut before the restart was read again"
        verify_index(dc)
        dc.check_invariants()
    finally:
        dc.close()


def test_undamaged_disk_pool_serves_every_prompt_from_disk_and_restarts_again(tmp_path):
    """The control row: without damage every prompt is a full hit from disk and nothing is counted
    corrupt (so the table's cuts come from the damage, not from the harness). Then a second
    restart on the same boot: it used to be refused (HeaderMismatchError on the host pool's file
    id), because the host pool recreated after the reboot had a new id that no checkpoint saved."""
    b = build(tmp_path)
    dc = open_cache(b.state_dir, b.shm_dir, verify="eager")
    try:
        assert _serve_all(dc) == [len(s) for s in b.slots]
        assert dc.cache.stats.corrupt_blocks == 0
        assert dc.cache.stats.hit_tokens_by_tier[DISK] > 0
    finally:
        dc.close()
    dc = open_cache(b.state_dir, b.shm_dir)
    try:
        assert dc.recovery["keep_host"] is True
        assert _serve_all(dc) == [len(s) for s in b.slots]
    finally:
        dc.close()


# -- damage to the LMDB file ----------------------------------------------------------------------------

def _token_offsets(data: bytes) -> list[int]:
    """Every place the first two tokens of prompt 0 occur (live records and stale copies)."""
    pattern = np.asarray(PROMPTS[0][:2], "<i4").tobytes()
    found, i = [], data.find(pattern)
    while i >= 0:
        found.append(i)
        i = data.find(pattern, i + 1)
    assert found, "the committed tokens are not in the LMDB file"
    return found


def _mdb(b: Built) -> str:
    return os.path.join(b.state_dir, "wal", "data.mdb")


def lmdb_flip_bits_in_records(b: Built) -> None:
    path = _mdb(b)
    data = bytearray(Path(path).read_bytes())
    for off in _token_offsets(data):
        data[off + 1] ^= 0x10
    Path(path).write_bytes(data)


def lmdb_zero_record_pages(b: Built) -> None:
    path = _mdb(b)
    data = bytearray(Path(path).read_bytes())
    for off in _token_offsets(data):
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


LMDB_TABLE = [
    LmdbDamage("flip bits in a log record", lmdb_flip_bits_in_records, False,
               "prefixd.wal.errors.WalCorruptError", r"lsn \d+ in .*: checksum mismatch"),
    LmdbDamage("flip bits in a checkpoint chunk", lmdb_flip_bits_in_records, True,
               "prefixd.wal.errors.WalCorruptError", r"checkpoint key .* checksum mismatch"),
    LmdbDamage("zero the page of a log record", lmdb_zero_record_pages, False,
               "prefixd.wal.errors.WalCorruptError", r"damaged LMDB page.*structural check"),
    LmdbDamage("zero the page of a checkpoint chunk", lmdb_zero_record_pages, True,
               "prefixd.wal.errors.WalCorruptError", r"damaged LMDB page.*structural check"),
    LmdbDamage("truncate past the meta pages", lmdb_truncate_past_the_meta_pages, False,
               "prefixd.wal.errors.WalCorruptError", r"data\.mdb is \d+ bytes"),
    LmdbDamage("truncate past the meta pages, checkpointed", lmdb_truncate_past_the_meta_pages, True,
               "prefixd.wal.errors.WalCorruptError", r"data\.mdb is \d+ bytes"),
    LmdbDamage("truncate inside the meta pages", lmdb_truncate_inside_the_meta_pages, False,
               "prefixd.wal.errors.WalCorruptError", r"data\.mdb is 4096 bytes"),
    # An empty data.mdb is what LMDB creates for a new directory: starting a new cache there
    # would leave the old disk pool unseen on disk, so recovery refuses and says what to do.
    LmdbDamage("truncate to zero", lmdb_truncate_to_zero, False,
               "prefixd.engine.errors.IndexLostError", r"has disk pool\(s\) prefixd-.*\.disk\.pool but no index"),
]


@pytest.fixture(scope="module")
def lmdb_outcomes(tmp_path_factory) -> dict[str, dict]:
    """Every LMDB row, damaged and recovered in one child (one interpreter start for the table):
    row name -> what its recovery reported, or ``{"died": rc}``."""
    dirs = {}
    for row in LMDB_TABLE:
        b = build(tmp_path_factory.mktemp("lmdb"))
        if row.checkpoint:
            dc = open_cache(b.state_dir, b.shm_dir)
            dc.checkpoint()
            dc.close()
        row.damage(b)
        dirs[row.name] = b
    cmd = [sys.executable, "-m", "tests.crash.test_corruption", "recover",
           json.dumps({name: [b.state_dir, b.shm_dir] for name, b in dirs.items()})]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, f"the recovery driver failed rc={out.returncode}: {out.stderr[-800:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
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
        served = _serve_all(dc)
        verify_index(dc)
        dc.check_invariants()
    finally:
        dc.close()
    return {"served": served}


def _recover_main(dirs: dict[str, list[str]]) -> None:
    """Driver: recover each state dir in a forked child, so that a signal kills only that one."""
    results = {}
    for name, (state_dir, shm_dir) in dirs.items():
        out_path = os.path.join(os.path.dirname(state_dir), "recovery.json")
        err_path = os.path.join(os.path.dirname(state_dir), "recovery.err")
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the forked child
            code = 0
            try:
                fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 2)
                with open(out_path, "w") as f:
                    json.dump(_recover_one(state_dir, shm_dir), f)
            except BaseException:  # noqa: BLE001 - reported as a death with its traceback
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        if rc == 0:
            with open(out_path) as f:
                results[name] = json.load(f)
        else:
            results[name] = {"died": rc, "stderr": Path(err_path).read_text()[-800:]}
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:2] != ["recover"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tests.crash.test_corruption recover '{\"row\": [STATE_DIR, SHM_DIR]}'")
    _recover_main(json.loads(sys.argv[2]))
