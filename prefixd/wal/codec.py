"""Record codec: ``kind u8 | fixed fields | blob | crc32c u32``, and the 8-byte lsn key.

The value of one ``log`` entry is::

    offset 0            kind        u8
    offset 1            fields      the kind's struct layout, little-endian, no padding
    offset fixed_size   blob        0..n bytes (only kinds with a blob; layout owned by the cache)
    last 4 bytes        crc32c      u32 little-endian, over every byte before it

The key is the lsn as a big-endian u64, so LMDB's byte order is lsn order and a group is written
with ``MDB_APPEND``. The blob length is implicit (value length - fixed size - 4).

NOTE: crc32c rather than a 64-bit hash: it detects every 1- and 2-bit flip and every burst up to
32 bits by construction, it is a single C call (google-crc32c, SSE4.2), and 4 bytes instead of 8
matter on ~30-byte records. The lsn is not covered: the key and value live in the same LMDB page
and the B-tree keeps them together; replay additionally checks that lsns are contiguous.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import google_crc32c

from prefixd.wal.errors import WalCorruptError
from prefixd.wal.kinds import CODECS, Kind

_KEY = struct.Struct(">Q")
_CRC = struct.Struct("<I")
_crc32c = google_crc32c.value
_crc32c_extend = google_crc32c.extend

KEY_SIZE = _KEY.size
CRC_SIZE = _CRC.size

pack_key = _KEY.pack
_CRC_PACK = _CRC.pack


def _unknown_kind(kind: int, *fields: object) -> bytes:
    raise TypeError(f"unknown record kind {kind}")


# Hot-path tables indexed by kind code (a list index is cheaper than attribute access).
_PACK = [c.struct.pack if c is not None else _unknown_kind for c in CODECS]
_HAS_BLOB = [c is not None and c.spec.blob for c in CODECS]


class Record(NamedTuple):
    """One decoded record: ``lsn``, ``kind``, ``fields`` (the kind's fixed fields in wire order),
    ``blob`` (``b""`` for kinds without one)."""

    lsn: int
    kind: Kind
    fields: tuple
    blob: bytes


def unpack_key(key: bytes) -> int:
    """Return the lsn stored in a ``log`` key.

    Raises:
        WalCorruptError: the key is not 8 bytes.
    """
    if len(key) != KEY_SIZE:
        raise WalCorruptError(-1, f"log key of {len(key)} bytes (want {KEY_SIZE}): {key[:16]!r}")
    return _KEY.unpack(key)[0]


def encode(kind: int, fields: tuple, blob: bytes = b"") -> bytes:
    """Encode one record value (without its lsn, which is the key).

    Args:
        kind: a ``Kind`` code.
        fields: the kind's fixed fields in wire order.
        blob: trailing bytes; only for kinds declared with a blob.

    Returns:
        The value bytes, checksum included.

    Raises:
        ValueError: unknown kind, wrong number or range of fields, or a blob on a blob-less kind.
    """
    try:
        head = _PACK[kind](kind, *fields)
    except (IndexError, TypeError, struct.error) as exc:
        raise _encode_error(kind, fields, exc) from None
    if blob:
        if not _HAS_BLOB[kind]:
            raise ValueError(f"{Kind(kind).name} records carry no blob (got {len(blob)} bytes)")
        return b"".join((head, blob, _CRC_PACK(_crc32c_extend(_crc32c(head), blob))))
    return head + _CRC_PACK(_crc32c(head))


def frame(body: bytes) -> bytes:
    """``body`` (kind | fixed fields | blob, packed by the kind's ``struct``) with its crc32c
    appended: the value ``encode`` makes, for an encoder that packs its own fields and knows
    its kind's layout (``prefixd.engine.records``). Nothing about ``body`` is checked here."""
    return body + _CRC_PACK(_crc32c(body))


def _encode_error(kind: object, fields: tuple, exc: Exception) -> ValueError:
    codec = CODECS[kind] if isinstance(kind, int) and 0 <= kind < 256 else None
    if codec is None:
        return ValueError(f"unknown record kind {kind!r}")
    names = [n for n, _ in codec.spec.fields]
    return ValueError(f"{codec.kind.name} takes fields {names} ({codec.struct.format}), got {fields!r}: {exc}")


def decode(lsn: int, value: bytes) -> Record:
    """Decode and verify one record value read from the key ``lsn``.

    Raises:
        WalCorruptError: too short, bad checksum, unknown kind, or bytes after the fields of a
            kind without a blob. Carries ``lsn``.
    """
    size = len(value)
    if size < 1 + CRC_SIZE:
        raise WalCorruptError(lsn, f"record of {size} bytes is shorter than kind + checksum")
    body = value[:-CRC_SIZE]
    (stored,) = _CRC.unpack_from(value, size - CRC_SIZE)
    actual = _crc32c(body)
    if actual != stored:
        raise WalCorruptError(lsn, f"checksum mismatch: stored {stored:#010x}, computed {actual:#010x}")
    codec = CODECS[value[0]]
    if codec is None:
        raise WalCorruptError(lsn, f"unknown record kind {value[0]}")
    end = size - CRC_SIZE
    if end < codec.fixed_size:
        raise WalCorruptError(
            lsn, f"{codec.kind.name} record has {end} bytes before its checksum, needs {codec.fixed_size}"
        )
    fields = codec.struct.unpack_from(value)[1:]
    if end == codec.fixed_size:
        return Record(lsn, codec.kind, fields, b"")
    if not codec.spec.blob:
        raise WalCorruptError(lsn, f"{codec.kind.name} record has {end - codec.fixed_size} trailing bytes")
    return Record(lsn, codec.kind, fields, value[codec.fixed_size : end])
