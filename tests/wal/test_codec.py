"""Record codec: round trip for every kind, checksums, input validation."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.wal import KIND_SPECS, Kind, WalCorruptError, decode, encode, field_names
from prefixd.wal.kinds import KindSpec, _check_table

_FIELD = {
    "Q": st.integers(0, 2**64 - 1),
    "I": st.integers(0, 2**32 - 1),
    "B": st.integers(0, 255),
    "d": st.floats(allow_nan=False),
}


@st.composite
def records(draw):
    spec = draw(st.sampled_from(KIND_SPECS))
    fields = tuple(draw(_FIELD[code]) for _, code in spec.fields)
    blob = draw(st.binary(max_size=300)) if spec.blob else b""
    return spec, fields, blob


@given(records(), st.integers(1, 2**63))
@settings(max_examples=300, deadline=None)
def test_round_trip_every_kind(rec, lsn):
    spec, fields, blob = rec
    got = decode(lsn, encode(spec.code, fields, blob))
    assert got.lsn == lsn and got.kind == spec.code and got.kind.name == spec.name
    assert got.fields == fields and got.blob == blob


def test_every_kind_is_covered_and_named_in_order():
    assert [k.name for k in Kind] == [s.name for s in KIND_SPECS]
    assert field_names(Kind.OPEN) == ("seq_id", "session_id", "num_tokens", "num_cached_blocks")
    assert field_names(Kind.TOUCH) == ("time", "num_blocks")
    # fixed layout: kind + fields + crc, nothing else (a tuple layout, not a dict)
    assert len(encode(Kind.RELEASE, (7,))) == 1 + 8 + 4
    assert len(encode(Kind.BLOCK_PUT, (1, 3), b"x" * 10)) == 1 + 1 + 4 + 10 + 4


@given(records(), st.data())
@settings(max_examples=200, deadline=None)
def test_checksum_catches_any_flipped_bit(rec, data):
    spec, fields, blob = rec
    value = bytearray(encode(spec.code, fields, blob))
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(WalCorruptError) as err:
        decode(42, bytes(value))
    assert err.value.lsn == 42 and "42" in str(err.value)


def test_decode_rejects_short_and_trailing_bytes():
    with pytest.raises(WalCorruptError, match="shorter"):
        decode(3, b"\x01\x00")
    good = encode(Kind.RELEASE, (1,))
    body = good[:-4] + b"zz"  # trailing bytes on a blob-less kind, with a valid checksum
    import google_crc32c

    with pytest.raises(WalCorruptError, match="trailing"):
        decode(4, body + struct.pack("<I", google_crc32c.value(body)))
    body = bytes([200]) + b"abc"
    with pytest.raises(WalCorruptError, match="unknown record kind"):
        decode(5, body + struct.pack("<I", google_crc32c.value(body)))


@pytest.mark.parametrize(
    "args, match",
    [
        ((99, (1,)), "unknown record kind"),
        ((Kind.OPEN, (1, 2)), "OPEN takes fields"),
        ((Kind.COMMIT, (1, -1)), "out of range|COMMIT takes"),
        ((Kind.RELEASE, (1,), b"x"), "carry no blob"),
        ((Kind.ATTACH, (1, 2**32)), "ATTACH takes"),
    ],
)
def test_encode_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        encode(*args)


def test_kind_table_refuses_reused_codes():
    dup = KIND_SPECS + (KindSpec(1, "AGAIN", (), False),)
    with pytest.raises(ValueError, match="unique"):
        _check_table(dup)
