"""Record values: what ``encode_event`` / ``encode_events`` write, the ``decode_*`` functions and
``RUN`` read back."""

import pytest

from prefixd.cache import events as ev
from prefixd.cache.node import DEVICE, DISK, HOST
from prefixd.engine import records
from prefixd.wal.codec import decode, encode
from prefixd.wal.kinds import Kind

H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def _value(event, session_id: int = 0) -> bytes:
    return records.encode_event(event, session_id)


def _blob(event) -> bytes:
    return decode(1, records.encode_event(event)).blob


# Each event type's record as the module's table spells it: (kind, fixed fields, blob). The
# encoders pack their own fields; their bytes must be exactly the generic codec's.
_SPEC = [
    (ev.SeqOpened(5, 40, 2, H1, b"x"), (Kind.OPEN, (5, 9, 40, 2), H1 + b"x")),
    (ev.SeqOpened(5, 40, 0, b"", b""), (Kind.OPEN, (5, 9, 40, 0), records.ZERO_HASH)),
    (ev.SeqExtended(6, 70), (Kind.EXTEND, (6, 70), b"")),
    (ev.BlockCopied(6, 3, 4), (Kind.COW, (6, 3, 4), b"")),
    (ev.SeqForked(8, (11, 12, 13)), (Kind.FORK, (8, 11, 3), b"")),
    (ev.SeqCommitted(6, 3, H2), (Kind.COMMIT, (6, 3), H2)),
    (ev.SeqReleased(7), (Kind.RELEASE, (7,), b"")),
    (ev.BlocksStored(H1, [H2, H3], b"t" * 8, [1, 2]),
     (Kind.BLOCK_PUT, (0, 2), H1 + H2 + H3 + b"t" * 8 + b"\x01\0\0\0\x02\0\0\0")),
    (ev.BlocksMoved(HOST, [H1, H2, H3], [4, 5, 6], []),
     (Kind.BLOCK_MOVE, (HOST, 3), H1 + H3 + b"\x04\0\0\0\x05\0\0\0\x06\0\0\0")),
    (ev.BlocksMoved(DEVICE, [H1, H2], [4, 5], [7, 8]),
     (Kind.BLOCK_MOVE, (DEVICE, 2), H1 + H2 + (7).to_bytes(8, "little") + (8).to_bytes(8, "little"))),
    (ev.BlocksDropped(DISK, [H1, H2, H3], [3, 4, 5], True), (Kind.BLOCK_DROP, (DISK, 3), H1 + H3)),
]


@pytest.mark.parametrize("event,spec", _SPEC, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(_SPEC)])
def test_each_event_encodes_to_the_codecs_bytes_for_its_table_row(event, spec):
    kind, fields, blob = spec
    assert records.encode_event(event, session_id=9) == encode(kind, fields, blob)


def test_every_event_type_of_the_core_has_an_encoder():
    logged = {type(e) for e, _ in _SPEC}
    core = {v for v in vars(ev).values() if isinstance(v, type) and issubclass(v, tuple) and v is not tuple}
    assert core == logged, f"event types without a record row in this test: {core ^ logged}"


def test_encode_events_keeps_order_and_scan_finds_the_first_disk_move_and_counts_replay_blocks():
    events = [e for e, _ in _SPEC] + [ev.BlocksMoved(DISK, [H1, H2], [1, 2], [5, 6]),
                                      ev.BlocksMoved(DISK, [H3], [9], []),
                                      ev.BlocksDropped(HOST, [H1, H2], [1, 2], False)]
    assert records.encode_events(events, session_id=9) == [records.encode_event(e, 9) for e in events]
    scan = records.scan_events(events)
    assert scan.first_disk_move == len(_SPEC)
    # a put's 2 hashes, the host move's 3, the forgotten drop's 3, the disk moves' 2 + 1; the
    # device moves and the kept drop name their runs by their ends: none
    assert scan.blocks == 2 + 3 + 3 + 2 + 1
    assert records.scan_events(events[:len(_SPEC)]).first_disk_move == -1


def test_an_event_that_does_not_fit_its_record_is_refused_whole():
    with pytest.raises(ValueError, match="SeqExtended does not fit"):
        records.encode_events([ev.SeqReleased(1), ev.SeqExtended(2, 2**32)])
    with pytest.raises(TypeError, match="no record for event"):
        records.encode_events([ev.SeqReleased(1), ("not", "an", "event")])


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
    blob = _blob(ev.BlocksMoved(DISK, [H1, H2, H3, H1], slots, sums))
    want = b"".join(s.to_bytes(4, "little") for s in slots) + b"".join(c.to_bytes(8, "little") for c in sums)
    assert blob == H1 + H1 + want
    put = _blob(ev.BlocksStored(H1, [H2], b"t" * 64, [2**32 - 1]))
    assert put.endswith(b"\xff\xff\xff\xff")


@pytest.mark.parametrize("slot", [-1, 2**32])
def test_a_slot_outside_u32_is_refused_not_wrapped(slot):
    """A slot that does not fit u32 must raise, never be logged as another slot."""
    with pytest.raises(OverflowError):
        records.encode_event(ev.BlocksMoved(HOST, [H1], [slot], []))
