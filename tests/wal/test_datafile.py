"""The bounds walk of ``data.mdb`` before LMDB maps it (``datafile.check_structure``, ``pagewalk``).

A damaged value size makes py-lmdb touch pages past the end of the file as it hands the value
out: a SIGBUS that kills the daemon at every start. These tests damage a real log the way a
flipped bit does and check the open refuses it, typed; the control shows the same file kills a
reader that skips the walk.
"""

from __future__ import annotations

import os
import signal
import struct

import pytest

from lmdb import verify as lmdb_verify

from prefixd.wal import Kind, WalCorruptError, pagewalk
from prefixd.wal import datafile
from prefixd.wal.datafile import _metas, meta_problems, newest_meta
from prefixd.wal.env import MAX_MAP_SIZE, WalEnv

from .conftest import raw_env, run_child

NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi (the value size's two halves), mn_flags, mn_ksize
F_BIGDATA = 0x01
META_LAST_PG = 136  # mm_last_pg's offset in a meta page


def _log_items(state_dir: str) -> list[tuple[bytes, bytes]]:
    env = raw_env(state_dir)
    try:
        log = env.open_db(b"log")
        with env.begin() as txn:
            return list(txn.cursor(db=log))
    finally:
        env.close()


def _write_log(open_wal, blob_bytes: int, n: int = 40) -> None:
    wal = open_wal()
    for i in range(n):
        wal.append(Kind.COMMIT, i, 1, blob=os.urandom(blob_bytes))
    wal.flush().result(10)
    wal.close()


def _node_of(raw: bytes, key: bytes, value: bytes) -> int:
    """Offset in ``raw`` of the leaf node that holds ``key`` -> ``value`` (in its page, or
    pointing at its overflow pages)."""
    at = raw.find(value)
    assert at > 0 and raw.find(value, at + 1) < 0, "the value is not in the file exactly once"
    in_page = at - len(key) - NODE.size
    lo, hi, flags, ksize = NODE.unpack_from(raw, in_page)
    if ksize == len(key) and raw[in_page + NODE.size:at] == key and lo | hi << 16 == len(value):
        return in_page
    psize = _page_size(raw)
    assert (at - 16) % psize == 0, "a big value starts after its overflow page's header"
    pointer = raw.find(key + struct.pack("<Q", (at - 16) // psize))
    assert pointer > 0, "no leaf node points at the value's overflow pages"
    node = pointer - NODE.size
    lo, hi, flags, ksize = NODE.unpack_from(raw, node)
    assert flags & F_BIGDATA and lo | hi << 16 == len(value)
    return node


def _page_size(raw: bytes) -> int:
    return struct.unpack_from("<I", raw, 40)[0]


def _grow_value_size(path: str, key: bytes, value: bytes, by_64k: int) -> None:
    """Add ``by_64k`` x 64 KiB to the stored size of ``value`` (a flipped bit in its high half)."""
    with open(path, "r+b") as f:
        raw = f.read()
        node = _node_of(raw, key, value)
        lo, hi, flags, ksize = NODE.unpack_from(raw, node)
        f.seek(node)
        f.write(NODE.pack(lo, hi + by_64k, flags, ksize))


REPLAY_CHILD = """
import sys
from prefixd.wal import Wal, WalCorruptError
from prefixd.wal import env
if {skip_walk}:
    env.check_structure = lambda path, state_dir, max_map_size=None: None  # the reader without the walk
try:
    with Wal({state!r}, layouts=b"layout-v1") as wal:
        print("replayed", sum(1 for _ in wal.replay()))
except WalCorruptError as exc:
    print("typed:", exc)
"""


@pytest.mark.parametrize("blob_bytes", [200, 3000], ids=["in-page value", "overflow value"])
def test_a_value_size_past_the_file_is_refused_before_any_read(state_dir, open_wal, blob_bytes):
    """Guards against the bit-flip soak's SIGBUS (1 in 5,280 trials): a damaged value size sent
    py-lmdb's page touch 16 MiB past the end of the file while the log was replayed."""
    _write_log(open_wal, blob_bytes)
    key, value = _log_items(state_dir)[20]
    _grow_value_size(os.path.join(state_dir, "wal", "data.mdb"), key, value, by_64k=256)
    out = run_child(REPLAY_CHILD.format(state=state_dir, skip_walk=False))
    assert out.returncode == 0, f"the open died: rc={out.returncode} {out.stderr[-1500:]}"
    assert "typed:" in out.stdout and "fails the structural check" in out.stdout, out.stdout
    assert "restore it from a backup" in out.stdout


def test_control_without_the_walk_the_same_damage_kills_the_reader(state_dir, open_wal):
    """The positive control of the test above: the damage it plants is a SIGBUS without the walk
    (for an overflow value LMDB checks nothing; an in-page one it refuses itself)."""
    _write_log(open_wal, 3000)
    key, value = _log_items(state_dir)[20]
    _grow_value_size(os.path.join(state_dir, "wal", "data.mdb"), key, value, by_64k=256)
    out = run_child(REPLAY_CHILD.format(state=state_dir, skip_walk=True))
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stdout, out.stderr[-800:])


def test_an_overflow_page_too_short_for_its_value_is_refused(state_dir, open_wal):
    _write_log(open_wal, 3000)
    key, value = _log_items(state_dir)[5]
    path = os.path.join(state_dir, "wal", "data.mdb")
    with open(path, "r+b") as f:
        raw = f.read()
        node = _node_of(raw, key, value)
        (pgno,) = struct.unpack_from("<Q", raw, node + NODE.size + len(key))
        f.seek(pgno * _page_size(raw) + 12)  # mp_pages: 1, the value needs 1 + 3000 bytes: 1 page
        f.write(struct.pack("<I", 0))
    with pytest.raises(WalCorruptError, match=f"overflow page {pgno} .*0 pages.*does not hold a value of {len(value)}"):
        open_wal()


def _free_record(state_dir: str) -> tuple[str, list[int], int, list[int], set[int]]:
    """A log with freed pages; ``(path, offsets of a free-list record's value in the file (the
    live one and older copies in free pages: damage them all), its txnid, its page numbers, the
    pages the trees use)``, found by the walk itself."""
    path = os.path.join(state_dir, "wal", "data.mdb")
    meta, offset = max(_metas(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        w = pagewalk._Walk(fd, meta[2], meta[0], meta[1] + 1, os.path.getsize(path))
        w.tree("free", struct.unpack_from("<Q", os.pread(fd, 136, offset), 80)[0], is_free=True)
        w.tree("main", struct.unpack_from("<Q", os.pread(fd, 136, offset), 128)[0])
    finally:
        os.close(fd)
    assert not w.problems and w.free, "the log has no free-list record to damage"
    txnid, value = next((t, v) for t, v in w.free if len(v) <= 512)  # an in-page one
    raw = open(path, "rb").read()
    key = struct.pack("<Q", txnid)
    at = []
    start = raw.find(key + value)
    while start >= 0:
        at.append(start + 8)
        start = raw.find(key + value, start + 1)
    assert at, "the record is not in the file"
    pages = list(struct.unpack_from(f"<{len(value) // 8 - 1}Q", value, 8))
    return path, at, txnid, pages, w.seen


def _log_with_freed_pages(open_wal) -> None:
    wal = open_wal()
    for i in range(200):
        wal.append(Kind.COMMIT, i, 1, blob=os.urandom(150))
    wal.flush().result(10)
    wal.checkpoint(150, {b"k": b"v"}, {})  # deletes the records before it: their pages go free
    wal.append(Kind.COMMIT, 999, 1, blob=b"x")
    wal.flush().result(10)
    wal.close()


def test_a_page_listed_free_but_in_use_is_refused(state_dir, open_wal):
    """LMDB allocates from the free list without looking: the open's own write transaction would
    overwrite a page a tree still points at."""
    _log_with_freed_pages(open_wal)
    path, at, txnid, pages, live = _free_record(state_dir)
    lowest = min(pages)
    in_use = max(p for p in live if p < lowest) if any(p < lowest for p in live) else None
    if in_use is None:
        pytest.skip("no tree page below the free list's pages")  # not with this log's layout
    with open(path, "r+b") as f:
        for value_at in at:
            f.seek(value_at + 8 * len(pages))  # the last (lowest) page number of the record
            f.write(struct.pack("<Q", in_use))
    with pytest.raises(WalCorruptError, match=f"page {in_use} listed free but in use"):
        open_wal()


@pytest.mark.parametrize("chunk", [pagewalk.LEVEL_CHUNK, 1], ids=["one pass a level", "a pass a page"])
def test_a_free_list_txnid_past_the_meta_is_refused(state_dir, open_wal, monkeypatch, chunk):
    """The bit-flip soak's SIGABRT: LMDB asserts on the free list's txnids (``mdb_freelist_save``).
    Also with a level checked a page at a time (what bounds the walk's memory on a large log)."""
    monkeypatch.setattr(pagewalk, "LEVEL_CHUNK", chunk)
    _log_with_freed_pages(open_wal)
    path, at, txnid, pages, live = _free_record(state_dir)
    newest = newest_meta(path)[0]
    with open(path, "r+b") as f:
        for value_at in at:
            f.seek(value_at - 8)
            f.write(struct.pack("<Q", newest + 1000))
    with pytest.raises(WalCorruptError, match=f"free DB record of txn {newest + 1000}: out of order or past"):
        open_wal()


def test_the_walk_and_lmdbs_own_verifier_both_pass_a_healthy_log(state_dir, open_wal):
    """The reference for the walk's page layout: on a log of in-page and overflow values, a
    checkpoint and a truncated head (free pages), py-lmdb's full verifier finds nothing either."""
    wal = open_wal()
    for i in range(300):
        wal.append(Kind.COMMIT, i, 1, blob=os.urandom(100 if i % 3 else 9000))
    wal.flush().result(10)
    wal.checkpoint(150, {b"k%05d" % i: os.urandom(5000) for i in range(40)}, {b"s1": os.urandom(300)})
    wal.close()
    path = os.path.join(state_dir, "wal", "data.mdb")
    assert lmdb_verify.verify(path, subdir=False) == []
    meta, offset = max(_metas(path))
    assert pagewalk.walk(path, meta, offset) == []


def test_a_leaked_page_is_not_refused(state_dir, open_wal):
    """A page neither reachable nor free costs space, not bytes: refusing it would throw away a
    cache that serves right bytes (``lmdb.verify`` reports it; the walk does not look)."""
    _write_log(open_wal, 200)
    before = _log_items(state_dir)
    path = os.path.join(state_dir, "wal", "data.mdb")
    txnid, last_pg, psize = newest_meta(path)
    os.truncate(path, max(os.path.getsize(path), (last_pg + 2) * psize))
    with open(path, "r+b") as f:  # the newest meta claims one more page: it is in neither set
        for page in (0, 1):
            f.seek(page * psize + META_LAST_PG)
            pg, tx = struct.unpack("<QQ", f.read(16))
            if tx == txnid:
                f.seek(page * psize + META_LAST_PG)
                f.write(struct.pack("<Q", pg + 1))
    assert any("neither reachable nor in the freeDB" in p for p in lmdb_verify.verify(path, subdir=False))
    wal = open_wal()
    assert sum(1 for _ in wal.replay()) == len(before)
    wal.close()


def test_a_duplicate_sort_flag_on_the_free_db_is_refused(state_dir, open_wal):
    """The bit-flip soak's second SIGABRT (1 in 3,600 trials): a flipped bit made the meta's
    free DB duplicate-sorted, and LMDB asserted in ``mdb_cursor_init`` at the open."""
    _write_log(open_wal, 200, n=3)
    path = os.path.join(state_dir, "wal", "data.mdb")
    with open(path, "r+b") as f:
        for offset in (0, 4096):  # both meta pages: the newest is the one LMDB reads
            f.seek(offset + pagewalk.FREE_DB_AT + pagewalk.FLAGS_IN_DB)
            f.write(struct.pack("<H", pagewalk.FREE_DB_FLAGS | 0x04))
    with pytest.raises(WalCorruptError, match="the free DB has flags 0xc, not 0x8"):
        open_wal()
    out = run_child(REPLAY_CHILD.format(state=state_dir, skip_walk=True))  # the control
    assert out.returncode == -signal.SIGABRT, (out.returncode, out.stdout, out.stderr[-800:])


def test_a_walk_that_cannot_finish_is_a_typed_refusal(state_dir, open_wal, monkeypatch):
    _write_log(open_wal, 200, n=3)

    def broken(path, meta, offset):
        raise struct.error("unpack requires a buffer of 16 bytes")

    monkeypatch.setattr(pagewalk, "walk", broken)
    with pytest.raises(WalCorruptError, match="structural check: the walk stopped: error: unpack"):
        open_wal()


def _random_env(path, seed: int) -> None:
    """An LMDB environment of every shape the log takes: in-page, overflow and empty values,
    pages freed by deletes, several named databases, many transactions."""
    import random

    import lmdb

    rng = random.Random(seed)
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    dbs = [env.open_db(name) for name in (b"log", b"index", b"seqs")]
    keys: list[tuple[int, bytes]] = []
    for _ in range(rng.randrange(5, 40)):
        with env.begin(write=True) as txn:
            for _ in range(rng.randrange(1, 60)):
                db = rng.randrange(len(dbs))
                key = rng.randbytes(rng.choice((8, 8, 16, rng.randrange(1, 200))))
                size = rng.choice((0, 10, 300, 2000, 4000, 9000, rng.randrange(70000)))
                txn.put(key, rng.randbytes(size), db=dbs[db])
                keys.append((db, key))
            for _ in range(rng.randrange(0, 40)):
                if keys:
                    db, key = keys.pop(rng.randrange(len(keys)))
                    txn.delete(key, db=dbs[db])
    env.close()


@pytest.mark.parametrize("seed", range(60))
def test_the_walk_passes_every_healthy_file_lmdbs_verifier_passes(tmp_path, seed):
    """Guards against the walk refusing a sound log (a cache thrown away for nothing): random
    environments (``_random_env``), each passed by ``lmdb.verify`` too."""
    _random_env(tmp_path / "env", seed)
    data = str(tmp_path / "env" / "data.mdb")
    assert lmdb_verify.verify(data, subdir=False) == []
    meta, offset = max(_metas(data))
    assert pagewalk.walk(data, meta, offset) == []
    assert meta_problems(data, meta, offset, MAX_MAP_SIZE) == []


def _set_newest_last_pg(path: str, last_pg: int) -> None:
    txnid, _, psize = newest_meta(path)
    with open(path, "r+b") as f:
        for page in (0, 1):
            f.seek(page * psize + META_LAST_PG)
            if struct.unpack("<QQ", f.read(16))[1] == txnid:
                f.seek(page * psize + META_LAST_PG)
                f.write(struct.pack("<Q", last_pg))


def test_a_last_page_past_the_map_its_meta_was_written_with_is_refused(state_dir, open_wal, monkeypatch):
    """The bit-flip soak's 1 in 9,000 (seed 56,984): a flipped high bit of the newest meta's
    last page number. LMDB believed it: it mapped that much (64 TiB), past the log's ceiling,
    and the padding grows the file to match. Now refused before the padding, typed; the
    control (the check skipped) opens with the file grown past the map LMDB itself wrote."""
    _write_log(open_wal, 200, n=5)
    data = os.path.join(state_dir, "wal", "data.mdb")
    _, last_pg, psize = newest_meta(data)
    _set_newest_last_pg(data, last_pg | 1 << 18)  # 1 GiB of pages more: past the 1 GiB map
    size = os.path.getsize(data)
    with pytest.raises(WalCorruptError, match=r"names page \d+ as its last, \d+ bytes, past the 1073741824-byte map"):
        WalEnv(state_dir, sync=True)
    assert os.path.getsize(data) == size, "the refused file must be left as it was"
    monkeypatch.setattr(datafile, "meta_problems", lambda *args: [])  # the control
    wenv = WalEnv(state_dir, sync=True)
    try:
        assert wenv.map_size > 1 << 30 and os.path.getsize(data) > 1 << 30
    finally:
        wenv.close()


def test_a_last_page_past_the_logs_largest_map_is_refused(state_dir, open_wal, monkeypatch):
    """The log never grows its map past ``max_map_size``, so a last page beyond it is damage
    even inside the map the meta page names; the control opens past the ceiling, which the
    environment's invariants then catch (the soak's symptom: ``map_size <= max_map_size``)."""
    _write_log(open_wal, 200, n=5)
    data = os.path.join(state_dir, "wal", "data.mdb")
    _set_newest_last_pg(data, (128 << 20) // newest_meta(data)[2])  # 128 MiB: inside the 1 GiB map
    with pytest.raises(WalCorruptError, match=r"past the log's largest map \(67108864 bytes\)"):
        WalEnv(state_dir, sync=True, map_size=32 << 20, max_map_size=64 << 20)
    monkeypatch.setattr(datafile, "meta_problems", lambda *args: [])  # the control
    wenv = WalEnv(state_dir, sync=True, map_size=32 << 20, max_map_size=64 << 20)
    try:
        with pytest.raises(AssertionError):
            wenv.check_invariants()
    finally:
        wenv.close()


def test_a_map_grown_then_reopened_smaller_passes_the_meta_check(state_dir):
    """Guards the meta check against refusing a sound log: a map that grew (its meta pages say
    the grown size), reopened at the default size, opens."""
    wenv = WalEnv(state_dir, sync=False, map_size=1 << 20, max_map_size=64 << 20)
    try:
        for i in range(40):
            wenv.write(lambda txn, i=i: txn.put(b"%08d" % i, os.urandom(60000), db=wenv.log))
        assert wenv.num_map_grows > 0
    finally:
        wenv.close()
    data = os.path.join(state_dir, "wal", "data.mdb")
    meta, offset = max(_metas(data))
    assert meta_problems(data, meta, offset, 64 << 20) == []
    WalEnv(state_dir, sync=False, map_size=1 << 20, max_map_size=64 << 20).close()


def test_a_sound_file_that_ends_before_its_last_page_opens(tmp_path):
    """Regression: pages LMDB allocates and frees in one transaction go to the free list
    unwritten, so a sound ``data.mdb`` can end before the last page its meta names (seed 2:
    262 pages of 273). The open refused such a file as truncated; it must open, and a cut that
    removes pages a tree uses must still be refused as one."""
    from prefixd.wal.env import WalEnv

    wal_dir = tmp_path / "state" / "wal"
    wal_dir.mkdir(parents=True)
    _random_env(wal_dir, 2)
    data = str(wal_dir / "data.mdb")
    txnid, last_pg, psize = newest_meta(data)
    size = os.path.getsize(data)
    assert size < (last_pg + 1) * psize, "the precondition: the file ends before its last page"
    wenv = WalEnv(str(tmp_path / "state"), sync=True)
    wenv.close()
    assert os.path.getsize(data) >= (last_pg + 1) * psize  # padded over the unwritten pages
    os.truncate(data, size // 2)
    with pytest.raises(WalCorruptError, match=r"data\.mdb is \d+ bytes, but pages .* past its end: the file was truncated"):
        WalEnv(str(tmp_path / "state"), sync=True)
