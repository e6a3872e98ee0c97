"""Checkpoint: one-txn replace + fold, big values, interleaving with appends, crash atomicity."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from prefixd.crashpoints import CRASH_EXIT_CODE
from prefixd.wal import Kind, WalCorruptError
from prefixd.wal.checkpoint_store import CHUNK_SIZE

from .conftest import raw_env, run_child


def _fill(wal, n, start_seq=0):
    for i in range(n):
        wal.append(Kind.RELEASE, start_seq + i)
    return wal.flush().result(5)


def test_checkpoint_replaces_wholly_and_folds_the_log(open_wal):
    wal = open_wal()
    _fill(wal, 10)
    assert wal.checkpoint(6, {b"a": b"1", b"b": b"2"}, {b"s1": b"x"}) == 6
    assert wal.load_checkpoint() == (6, {b"a": b"1", b"b": b"2"}, {b"s1": b"x"})
    assert [r.lsn for r in wal.replay()] == [7, 8, 9, 10]
    assert [r.lsn for r in wal.replay(after_lsn=8)] == [9, 10]
    wal.checkpoint(10, {b"c": b""}, {})
    assert wal.load_checkpoint() == (10, {b"c": b""}, {})
    assert list(wal.replay()) == []
    assert wal.stats().checkpoints == 2
    wal.check_invariants()


def test_big_checkpoint_values_round_trip(open_wal):
    """A columnar checkpoint of several numpy arrays, tens of MB, chunked transparently."""
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**63, size=(1_000_000, 2), dtype=np.uint64)  # 16 MB
    slots = rng.integers(0, 2**31, size=3_000_000, dtype=np.uint32)  # 12 MB
    odd = rng.bytes(CHUNK_SIZE * 2 + 17)
    wal = open_wal()
    _fill(wal, 3)
    wal.checkpoint(3, {b"hashes": hashes, b"slots": slots.tobytes(), b"odd": odd}, {b"seqs": slots[:1000]})
    lsn, index, seqs = wal.load_checkpoint()
    assert lsn == 3
    assert np.array_equal(np.frombuffer(index[b"hashes"], dtype=np.uint64).reshape(-1, 2), hashes)
    assert index[b"slots"] == slots.tobytes() and index[b"odd"] == odd
    assert seqs[b"seqs"] == slots[:1000].tobytes()
    wal.checkpoint(3, {b"small": b"v"}, {})  # replacing it frees the big chunks
    assert wal.load_checkpoint() == (3, {b"small": b"v"}, {})


def test_checkpoint_serializes_with_concurrent_appends(open_wal):
    wal = open_wal(max_delay_ms=1)
    stop = threading.Event()
    appended = []

    def appender():
        while not stop.is_set():
            appended.append(wal.append(Kind.DETACH, len(appended)))

    _fill(wal, 50)
    thread = threading.Thread(target=appender)
    thread.start()
    try:
        for lsn in (20, 40, 50):
            wal.checkpoint(lsn, {b"k": str(lsn).encode()}, {})
    finally:
        stop.set()
        thread.join()
    last = wal.flush().result(5)
    assert wal.load_checkpoint()[0] == 50
    assert [r.lsn for r in wal.replay()] == list(range(51, last + 1))
    wal.check_invariants()


def test_checkpoint_refuses_bad_lsns_without_poisoning(open_wal):
    wal = open_wal()
    _fill(wal, 5)
    with pytest.raises(ValueError, match="beyond the last appended"):
        wal.checkpoint(6, {}, {})
    wal.checkpoint(4, {}, {})
    with pytest.raises(ValueError, match="below the saved checkpoint"):
        wal.checkpoint(2, {}, {})
    with pytest.raises(ValueError, match="checkpoint keys"):
        wal.checkpoint(4, {b"": b"x"}, {})
    assert wal.failure is None
    assert _fill(wal, 1) == 6


def test_crash_inside_checkpoint_keeps_the_old_one(state_dir, open_wal):
    wal = open_wal()
    _fill(wal, 10)
    wal.checkpoint(4, {b"old": b"index"}, {b"old": b"seqs"})
    wal.close()
    child = run_child(f"""
        from prefixd.wal import Wal
        wal = Wal({state_dir!r}, layouts=b"layout-v1")
        wal.checkpoint(10, {{b"new": b"x" * 3_000_000}}, {{}})
    """, crash="wal_checkpoint_inside:1")
    assert child.returncode == CRASH_EXIT_CODE, child.stderr
    wal = open_wal()
    assert wal.load_checkpoint() == (4, {b"old": b"index"}, {b"old": b"seqs"})
    assert [r.lsn for r in wal.replay()] == [5, 6, 7, 8, 9, 10]
    assert wal.append(Kind.RELEASE, 0) == 11


def test_checkpoint_from_a_ticket_callback_runs_inline(open_wal):
    """The cache may checkpoint from the committer context (a Future callback): no deadlock."""
    wal = open_wal()
    done = threading.Event()
    results = []

    def on_durable(ticket):
        results.append(wal.checkpoint(ticket.result(), {b"k": b"v"}, {}))
        done.set()

    _fill(wal, 3)
    wal.append(Kind.RELEASE, 9)
    wal.flush().add_done_callback(on_durable)
    assert done.wait(5) and results == [4]
    assert wal.load_checkpoint()[0] == 4


def test_corrupt_checkpoint_chunk_is_reported(state_dir, open_wal):
    wal = open_wal()
    _fill(wal, 2)
    wal.checkpoint(2, {b"k": b"value" * 100}, {})
    wal.close()
    env = raw_env(state_dir)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:
        key, value = next(iter(txn.cursor()))
        txn.put(key, value[:-1] + bytes([value[-1] ^ 4]))
    env.close()
    with pytest.raises(WalCorruptError, match="checksum") as err:
        open_wal().load_checkpoint()
    assert err.value.lsn == 2


def test_a_busy_appender_never_starves_a_checkpoint(open_wal):
    """Regression: a job used to run only when nothing was pending after a group, so an
    appender that kept more than one group's worth of records pending (a loaded daemon)
    postponed a checkpoint forever; a CI run hung here for 10 minutes."""
    wal = open_wal(max_delay_ms=1, max_group_records=8)
    stop = threading.Event()

    def appender():  # ~30 records/ms: more than a group of 8 per fsync can drain
        while not stop.is_set():
            for _ in range(16):
                wal.append(Kind.DETACH, 1)
            time.sleep(0.0005)

    _fill(wal, 10)
    thread = threading.Thread(target=appender)
    thread.start()
    try:
        time.sleep(0.2)  # let a backlog build
        done = wal.submit_checkpoint(10, {b"k": b"v"}, {}).result(timeout=10)
    finally:
        stop.set()
        thread.join()
    assert done == 10 and wal.load_checkpoint()[0] == 10
