"""Damage that the bit-flip fuzz found outside the records: each opens into WalCorruptError.

Meta values carry no checksum, and LMDB reports some damage with errors other than
``MDB_CORRUPTED``; each of these escaped as an untyped error (``struct.error``,
``msgpack.ExtraData``, ``lmdb.Error``) or a refusal that did not say what to do.
"""

import os

import pytest

from prefixd.wal import Kind, WalCorruptError
from prefixd.wal.meta import K_CHECKPOINT, K_FORMAT, K_KINDS, K_SEED

from .conftest import raw_env


def _put_meta(state_dir: str, key: bytes, value: bytes | None) -> None:
    env = raw_env(state_dir)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        if value is None:
            txn.delete(key)
        else:
            txn.put(key, value)
    env.close()


@pytest.mark.parametrize("key, value", [
    (K_CHECKPOINT, b"\x01\x02\x03"),  # struct.error in every reader of the checkpoint lsn
    (K_FORMAT, b"\x01" * 9),
    (K_KINDS, b"\x93\x01\x02\x03\xc1"),  # msgpack: a table followed by garbage (ExtraData)
    (K_KINDS, b"\x01"),  # decodes to an int, not a table (TypeError)
    (K_SEED, b"short"),
])
def test_a_damaged_meta_entry_is_a_typed_corruption(state_dir, open_wal, key, value):
    """Regression: a flipped length or byte in a meta value (no checksum there) escaped as
    ``struct.error``, ``msgpack.ExtraData`` or ``TypeError`` instead of naming the damage."""
    wal = open_wal()
    wal.append(Kind.DETACH, 1)
    wal.flush().result()
    wal.close()
    _put_meta(state_dir, key, value)
    with pytest.raises(WalCorruptError, match="restore it from a backup") as err:
        open_wal()
    assert err.value.path == os.path.realpath(state_dir)


def test_an_emptied_meta_database_beside_records_is_a_typed_corruption(state_dir, open_wal):
    """Regression: this was a StateMismatchError that named no way out."""
    wal = open_wal()
    wal.append(Kind.DETACH, 1)
    wal.flush().result()
    wal.close()
    env = raw_env(state_dir)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.drop(meta, delete=False)
    env.close()
    with pytest.raises(WalCorruptError, match="meta database is empty"):
        open_wal()


def test_a_flipped_lmdb_format_version_is_a_typed_corruption(state_dir, open_wal):
    """Regression: a bit flip in the version field of data.mdb's meta pages made ``lmdb.open``
    raise a bare ``lmdb.Error`` ("LMDB data format v131073 is not supported")."""
    open_wal().close()
    path = os.path.join(state_dir, "wal", "data.mdb")
    with open(path, "r+b") as f:
        for page in (0, 4096):  # both meta pages: mm_version (u32) at offset 20
            f.seek(page + 22)
            f.write(b"\x02")
    with pytest.raises(WalCorruptError, match="LMDB cannot open data.mdb"):
        open_wal()
