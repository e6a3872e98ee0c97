"""LMDB hygiene, state lock, meta validation, restart behaviour, replay verification."""

from __future__ import annotations

import os
import struct

import lmdb
import msgpack
import pytest

from prefixd.wal import (
    EnvAlreadyOpenError,
    ForkedEnvError,
    Kind,
    StateMismatchError,
    WalCorruptError,
)
from prefixd.wal.meta import K_EPOCH, K_FORMAT, K_KINDS, MAX_EPOCH

from .conftest import raw_env, run_child


def test_map_grows_from_a_tiny_map(open_wal):
    wal = open_wal(map_size=64 * 1024)
    blob = os.urandom(3000)
    for i in range(400):
        wal.append(Kind.BLOCK_PUT, 1, 24, blob=blob)
        if i % 50 == 49:
            wal.flush().result(10)
    wal.flush().result(10)
    wal.checkpoint(400, {b"big": os.urandom(2 << 20)}, {})
    stats = wal.stats()
    assert stats.map_grows >= 3 and wal._wenv.map_size > 64 * 1024
    assert wal.load_checkpoint()[0] == 400
    wal.check_invariants()


def test_second_open_in_the_same_process_is_refused(state_dir, open_wal):
    open_wal()
    with pytest.raises(EnvAlreadyOpenError, match="already open in this process"):
        open_wal()
    with pytest.raises(EnvAlreadyOpenError):
        open_wal(path=state_dir + "/../state")  # same directory through another path


def test_second_process_is_refused_by_the_lock(state_dir, open_wal):
    open_wal()
    child = run_child(f"""
        from prefixd.wal import Wal, StateLockedError
        try:
            Wal({state_dir!r})
        except StateLockedError as exc:
            print(exc.pid)
            print(exc)
    """)
    assert child.returncode == 0, child.stderr
    pid_line, message = child.stdout.splitlines()[:2]
    assert int(pid_line) == os.getpid() and f"pid {os.getpid()}" in message


def test_lock_is_released_on_close(state_dir, open_wal):
    open_wal().close()
    child = run_child(f"""
        from prefixd.wal import Wal
        Wal({state_dir!r}).close()
    """)
    assert child.returncode == 0, child.stderr


def test_use_after_fork_is_refused(open_wal):
    wal = open_wal()
    wal.append(Kind.RELEASE, 1)
    pid = os.fork()
    if pid == 0:  # child: every use must raise ForkedEnvError; close must not touch LMDB
        code = 0
        for use in (lambda: wal.append(Kind.RELEASE, 2), wal.flush, lambda: list(wal.replay()),
                    wal.load_checkpoint):
            try:
                use()
                code = 1
            except ForkedEnvError:
                pass
            except BaseException:
                code = 2
        wal.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert wal.flush().result(5) == 1  # the parent is unaffected


def test_layout_mismatch_is_refused(state_dir, open_wal):
    open_wal(layouts=b"layout-v1").close()
    with pytest.raises(StateMismatchError, match="layouts") as err:
        open_wal(layouts=b"layout-v2")
    assert err.value.path == os.path.realpath(state_dir)
    open_wal(layouts=None).close()  # offline tools skip the check


def test_format_version_mismatch_is_refused(state_dir, open_wal):
    open_wal().close()
    env = raw_env(state_dir)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        txn.put(K_FORMAT, struct.pack(">Q", 999))
    env.close()
    with pytest.raises(StateMismatchError, match="format_version.*999"):
        open_wal()


def test_changed_or_unknown_kinds_are_refused(state_dir, open_wal):
    open_wal().close()
    env = raw_env(state_dir)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        table = msgpack.unpackb(txn.get(K_KINDS))
        txn.put(K_KINDS, msgpack.packb(table + [[200, "FUTURE", "Q", False]]))
    env.close()
    with pytest.raises(StateMismatchError, match="FUTURE"):
        open_wal()
    env = raw_env(state_dir)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        table[1][2] = "QQ"  # DETACH laid out differently
        txn.put(K_KINDS, msgpack.packb(table))
    env.close()
    with pytest.raises(StateMismatchError, match="kind 2"):
        open_wal()


def test_meta_persists_seed_and_counts_epochs(state_dir, open_wal):
    first = open_wal()
    seed, boot = first.root_seed, first.meta.boot_id
    assert len(seed) == 16 and first.open_epoch() == 1 and first.meta.created
    first.close()
    second = open_wal()
    assert second.root_seed == seed and second.open_epoch() == 2 and not second.meta.created
    assert second.meta.previous_boot_id == boot == second.meta.boot_id


def test_an_epoch_past_what_records_carry_is_refused_as_damage(state_dir, open_wal):
    """Found by the bit-flip soak: a flipped high bit in the saved epoch made the open's RECOVER
    record fail to encode (its epoch is a u32) with an untyped ValueError."""
    open_wal().close()
    env = raw_env(state_dir)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        txn.put(K_EPOCH, struct.pack(">Q", (1 << 54) | 1))
    env.close()
    with pytest.raises(WalCorruptError, match="epoch .* damaged"):
        open_wal()
    env = raw_env(state_dir)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(K_EPOCH, struct.pack(">Q", MAX_EPOCH - 1))  # the last epoch a record carries
    env.close()
    assert open_wal().open_epoch() == MAX_EPOCH


@pytest.mark.parametrize("error", [lmdb.BadDbiError, lmdb.IncompatibleError])
def test_lmdb_finding_a_named_database_changed_is_a_typed_corruption(open_wal, error):
    """MDB_BAD_DBI (met by the bit-flip soak on the first read after open) and
    MDB_INCOMPATIBLE mean the main tree's record of a named database changed: damage."""
    wal = open_wal()

    def meets(txn):
        raise error("as LMDB raises it")

    with pytest.raises(WalCorruptError, match="damaged page while reading"):
        wal._wenv.read(meets)
    with pytest.raises(WalCorruptError, match="damaged page while writing"):
        wal._wenv.write(meets)


def test_an_io_error_writing_meta_at_open_is_a_typed_error_that_says_what_to_do(open_wal, monkeypatch):
    """Found by the bit-flip soak: LMDB answered the open's meta commit EIO (a short write of
    pages a damaged free list named) and the open ended in an untyped ``lmdb.Error``."""
    from prefixd.wal.env import WalEnv

    def fails(self, fn):
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    monkeypatch.setattr(WalEnv, "write", fails)
    with pytest.raises(WalCorruptError, match="damaged or its disk failed.*move the state directory away"):
        open_wal()


def test_an_open_pads_data_mdb_past_its_last_page_with_sparse_zeros(state_dir, open_wal):
    """A damaged in-page offset made LMDB read up to 64 KiB past a page near the file's end:
    a SIGBUS at open (bit-flip soak). The open pads the file so such a read finds zeros."""
    from prefixd.wal.datafile import TAIL_PAD, newest_meta

    wal = open_wal()
    for i in range(50):
        wal.append(Kind.COMMIT, i, 1, blob=os.urandom(3000))
    wal.flush().result(10)
    wal.close()
    path = os.path.join(state_dir, "wal", "data.mdb")
    _, last_pg, psize = newest_meta(path)
    assert os.path.getsize(path) < (last_pg + 1) * psize + TAIL_PAD  # LMDB's own file: no pad
    open_wal().close()  # the open pads (and then commits its meta transaction)
    _, last_pg, psize = newest_meta(path)
    used = (last_pg + 1) * psize
    st = os.stat(path)
    assert st.st_size >= used + TAIL_PAD // 2
    with open(path, "rb") as f:
        f.seek(used)
        assert f.read() == bytes(st.st_size - used)  # zeros past the last page
    assert st.st_blocks * 512 < used + TAIL_PAD // 2, "the padding took disk blocks"


def test_lsns_continue_after_restart(state_dir, open_wal):
    wal = open_wal()
    for i in range(7):
        wal.append(Kind.DETACH, i)
    wal.checkpoint(7, {}, {})  # the log is now empty: numbering continues from the checkpoint
    wal.close()
    wal = open_wal()
    assert wal.append(Kind.DETACH, 7) == 8
    wal.close()
    wal = open_wal()
    assert [r.lsn for r in wal.replay()] == [8]
    assert wal.append(Kind.DETACH, 8) == 9


def test_replay_reports_a_flipped_bit_with_its_lsn(state_dir, open_wal):
    wal = open_wal()
    for i in range(5):
        wal.append(Kind.COMMIT, i, 1, blob=b"h" * 20)
    wal.close()
    env = raw_env(state_dir)
    log = env.open_db(b"log")
    with env.begin(write=True, db=log) as txn:
        key = struct.pack(">Q", 3)
        value = bytearray(txn.get(key))
        value[10] ^= 0x10
        txn.put(key, bytes(value))
    env.close()
    wal = open_wal()
    replay = wal.replay()
    assert [next(replay).lsn for _ in range(2)] == [1, 2]
    with pytest.raises(WalCorruptError, match="checksum") as err:
        next(replay)
    assert err.value.lsn == 3 and err.value.path == os.path.realpath(state_dir)


def test_replay_reports_a_gap(state_dir, open_wal):
    wal = open_wal()
    for i in range(5):
        wal.append(Kind.DETACH, i)
    wal.close()
    env = raw_env(state_dir)
    log = env.open_db(b"log")
    with env.begin(write=True, db=log) as txn:
        txn.delete(struct.pack(">Q", 4))
    env.close()
    with pytest.raises(WalCorruptError, match="missing record") as err:
        list(open_wal().replay())
    assert err.value.lsn == 4


def test_replay_spans_batches(open_wal):
    from prefixd.wal import reader as replay_mod

    wal = open_wal()
    for i in range(25):
        wal.append(Kind.DETACH, i)
    wal.commit_now()
    got = [r.fields[0] for r in replay_mod.replay(wal._wenv, 0, batch=4)]
    assert got == list(range(25))


def test_prefetch_touches_the_log_after_an_lsn_and_ends(state_dir, open_wal):
    from prefixd.wal.reader import prefetch

    wal = open_wal()
    assert prefetch(wal._env(), 0) == 0  # an empty log
    for i in range(100):
        wal.append(Kind.DETACH, i)
    wal.flush().result()
    assert prefetch(wal._env(), 0, step=8) == 13  # lsns 1, 9, ..., 97
    assert prefetch(wal._env(), 95, step=8) == 1
    prefetching = wal.prefetch(0)
    assert prefetching.join(10)
    assert prefetching.lookups == 13
    assert [r.lsn for r in wal.replay()] == list(range(1, 101))  # a hint: nothing changed
