"""Record blobs: what ``event_records`` writes, the ``decode_*`` functions and ``RUN`` read back."""

import pytest

from prefixd.cache import events as ev
from prefixd.cache.node import DEVICE, DISK, HOST
from prefixd.engine import records
from prefixd.wal.codec import encode
from prefixd.wal.kinds import Kind

H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def _value(event, session_id: int = 0) -> bytes:
    kind, fields, blob = records.event_records(event, session_id)
    return encode(kind, fields, blob)


@pytest.mark.parametrize("deepest", [b"", H1])
def test_open_reads_back(deepest):
    value = _value(ev.SeqOpened(5, 40, 2, deepest, b"lora-7"), session_id=9)
    assert value[0] == Kind.OPEN
    assert records.decode_open(value) == (5, 9, deepest, b"lora-7")
    assert records.decode_seq_id(value) == 5


def test_commit_release_fork_and_recover_read_back():
    assert records.decode_commit(_value(ev.SeqCommitted(6, 3, H2))) == (6, H2)
    assert records.decode_seq_id(_value(ev.SeqReleased(7))) == 7
    assert records.decode_fork(_value(ev.SeqForked(8, (11, 12, 13)))) == (8, 11, 3)
    assert records.decode_recover(encode(Kind.RECOVER, (4, 1))) == (4, True)


def test_put_reads_back_without_its_device_slots():
    tokens = bytes(range(48))  # 3 blocks of 4 tokens
    value = _value(ev.BlocksStored(H1, [H1, H2, H3], tokens, [7, 8, 9]))
    assert records.decode_put(value) == (H1, [H1, H2, H3], tokens)


@pytest.mark.parametrize("tier,slots,sums", [
    (HOST, [4, 5, 6], []),
    (DISK, [1, 2, 3], [10, 20, 2**64 - 1]),
    (DEVICE, [9, 9, 9], [30, 40, 50]),  # device slots are not logged
    (DEVICE, [9, 9, 9], []),
])
def test_moves_read_back_through_the_run_offsets(tier, slots, sums):
    value = _value(ev.BlocksMoved(tier, [H1, H2, H3], slots, sums))
    assert records.decode_run(value) == (tier, 3, H1, H3)
    assert value[records.RUN.first:records.RUN.body] == H1 + H3  # replay's run key
    assert records.decode_move(value) == (None if tier == DEVICE else slots, sums)


def test_drops_read_back_through_the_run_offsets():
    value = _value(ev.BlocksDropped(DISK, [H1, H2], [3, 4], True))
    assert value[0] == Kind.BLOCK_DROP
    assert records.decode_run(value) == (DISK, 2, H1, H2)


def test_slots_and_checksums_are_little_endian_u32_and_u64_at_their_extremes():
    """The blob's slots and checksums are packed by ``array`` (was numpy): the bytes must be
    exactly ``<u4`` / ``<u8`` for every value a slot or an xxh3-64 checksum can take."""
    slots = [0, 1, 2**31, 2**32 - 1]
    sums = [0, 2**63, 2**64 - 1, 0x0102030405060708]
    _, _, blob = records.event_records(ev.BlocksMoved(DISK, [H1, H2, H3, H1], slots, sums))
    want = b"".join(s.to_bytes(4, "little") for s in slots) + b"".join(c.to_bytes(8, "little") for c in sums)
    assert blob == H1 + H1 + want
    _, _, put = records.event_records(ev.BlocksStored(H1, [H2], b"t" * 64, [2**32 - 1]))
    assert put.endswith(b"\xff\xff\xff\xff")


@pytest.mark.parametrize("slot", [-1, 2**32])
def test_a_slot_outside_u32_is_refused_not_wrapped(slot):
    """A slot that does not fit u32 must raise, never be logged as another slot."""
    with pytest.raises(OverflowError):
        records.event_records(ev.BlocksMoved(HOST, [H1], [slot], []))
