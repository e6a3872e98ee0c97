"""What the cache's events become in the write-ahead log, and how a record is read back.

The WAL stores ``kind | fixed fields | blob | crc32c`` (``prefixd.wal.codec``); this module
defines the blob of each kind the cache writes, and is the one place that knows it: the
encoders (``encode_event``, ``encode_events``, with ``scan_events``) and the decoders
(``decode_*``, and the ``RUN`` offsets that replay's hot loop binds) sit side by side. Hashes are 16 bytes, slots u32 little-endian,
checksums u64 little-endian.

=============  ================================================================
kind           blob
=============  ================================================================
OPEN           deepest shared block hash (16 bytes, or empty) || extra
COMMIT         hash of the sequence's last indexed block (16 bytes)
BLOCK_PUT      parent hash (16) || hashes (16 n) || tokens (n block_bytes) || device slots (4 n)
BLOCK_MOVE     first hash (16) || last hash (16) || slots (4 n; none into the device tier)
               || checksums (8 n, only when this copy established or changed them)
BLOCK_DROP     first hash (16) || last hash (16)
=============  ================================================================

A run is named by its first and last hash and its length (the ``num_blocks`` field): hashes
chain on the parent, so the last one names the whole path and the first one where the run
starts. Moves and drops are most of a log (every eviction writes one or two), and naming
every block of their run made them 3-20x larger than they are now, for nothing replay used.

``RECORDS_VERSION`` numbers these layouts; the checkpoint saves it and a state directory
written with another one is refused (``prefixd.engine.errors.StateFormatError``).
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import NamedTuple

from prefixd.cache import events as ev
from prefixd.cache.events import BlocksDropped, BlocksMoved, BlocksStored
from prefixd.cache.node import DEVICE, DISK
from prefixd.wal.codec import CRC_SIZE, frame
from prefixd.wal.kinds import CODECS, Kind

H = 16
ZERO_HASH = b"\x00" * H  # OPEN's "no shared block" (the deepest hash is then the root's)
RECORDS_VERSION = 3  # 1: moves and drops named every block; 2: device moves carried slots


# NOTE: ``array`` rather than ``numpy.asarray(values, "<u4")``: numpy converts a list of Python
# ints element by element through its dtype discovery and an overflow-checked setitem (~2 us
# for a 23-slot run, a quarter of the cost of submitting a commit's events);
# ``array`` packs the same bytes in a third of that and raises OverflowError alike.
assert array("I").itemsize == 4 and array("Q").itemsize == 8, "array codes I/Q must be u32/u64"
_SWAP = sys.byteorder != "little"


def _u32(values) -> bytes:
    packed = array("I", values)
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _u64(values) -> bytes:
    packed = array("Q", values)
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


# -- encoding ------------------------------------------------------------------------------------
#
# One function per event type packs the kind, its fixed fields (the kind's own ``struct``, from
# the kinds table) and its blob, and ``frame`` appends the crc32c: the bytes are exactly
# ``codec.encode(kind, fields, blob)``'s (a test holds every type to that), without building the
# ``(kind, fields, blob)`` tuple and going through ``encode``'s generic checks per record. A
# request makes ~9.5 records, and the tuples and checks were a third of their cost on the
# serving thread (docs/design.md, "The write order and free-before-reuse").

def _pack(kind: Kind):
    return CODECS[kind].struct.pack


_P_OPEN, _P_EXTEND, _P_COW, _P_FORK = _pack(Kind.OPEN), _pack(Kind.EXTEND), _pack(Kind.COW), _pack(Kind.FORK)
_P_COMMIT, _P_RELEASE = _pack(Kind.COMMIT), _pack(Kind.RELEASE)
_P_PUT, _P_MOVE, _P_DROP = _pack(Kind.BLOCK_PUT), _pack(Kind.BLOCK_MOVE), _pack(Kind.BLOCK_DROP)
_OPEN, _EXTEND, _COW, _FORK, _COMMIT, _RELEASE = (int(k) for k in (Kind.OPEN, Kind.EXTEND, Kind.COW, Kind.FORK,
                                                                  Kind.COMMIT, Kind.RELEASE))
_PUT, _MOVE, _DROP = int(Kind.BLOCK_PUT), int(Kind.BLOCK_MOVE), int(Kind.BLOCK_DROP)


def _opened(e, session_id):
    return frame(_P_OPEN(_OPEN, e.seq_id, session_id, e.num_tokens, e.num_cached_blocks)
                 + (e.deepest_hash or ZERO_HASH) + e.extra)


def _extended(e, session_id):
    return frame(_P_EXTEND(_EXTEND, e.seq_id, e.num_tokens))


def _copied(e, session_id):
    return frame(_P_COW(_COW, e.seq_id, e.old_slot, e.new_slot))


def _forked(e, session_id):
    ids = e.child_ids
    assert list(ids) == list(range(ids[0], ids[0] + len(ids))), "fork children must be consecutive"
    return frame(_P_FORK(_FORK, e.parent_id, ids[0], len(ids)))


def _committed(e, session_id):
    return frame(_P_COMMIT(_COMMIT, e.seq_id, e.num_indexed_blocks) + e.last_hash)


def _released(e, session_id):
    return frame(_P_RELEASE(_RELEASE, e.seq_id))


def _stored(e, session_id):
    hashes = e.hashes
    return frame(b"".join((_P_PUT(_PUT, 0, len(hashes)), e.parent_hash, *hashes, e.tokens, _u32(e.slots))))


def _moved(e, session_id):
    hashes, tier = e.hashes, e.tier
    sums = _u64(e.checksums) if e.checksums else b""
    if tier == DEVICE:  # device residency never survives a restart: only the fact is logged
        return frame(b"".join((_P_MOVE(_MOVE, tier, len(hashes)), hashes[0], hashes[-1], sums)))
    return frame(b"".join((_P_MOVE(_MOVE, tier, len(hashes)), hashes[0], hashes[-1], _u32(e.slots), sums)))


def _dropped(e, session_id):
    hashes = e.hashes
    return frame(b"".join((_P_DROP(_DROP, e.tier, len(hashes)), hashes[0], hashes[-1])))


_ENCODERS = {
    ev.SeqOpened: _opened, ev.SeqExtended: _extended, ev.BlockCopied: _copied, ev.SeqForked: _forked,
    ev.SeqCommitted: _committed, ev.SeqReleased: _released, BlocksStored: _stored, BlocksMoved: _moved,
    BlocksDropped: _dropped,
}


def encode_event(event, session_id: int = 0) -> bytes:
    """One event's WAL value (``kind | fields | blob | crc32c``; OPEN carries ``session_id``).

    Raises:
        TypeError: no record for this event type. ValueError: a field does not fit its kind's
        layout (``struct.error``). OverflowError: a slot or checksum outside u32 / u64.
    """
    encoder = _ENCODERS.get(type(event))
    if encoder is None:
        raise TypeError(f"no record for event {event!r}")
    try:
        return encoder(event, session_id)
    except struct.error as exc:
        raise ValueError(f"{type(event).__name__} does not fit its record: {exc}: {event!r}") from None


def encode_events(events, session_id: int = 0) -> list[bytes]:
    """The WAL values of ``events`` (``encode_event`` each), in order. Raises as
    ``encode_event`` (nothing is returned for any event then)."""
    encoders = _ENCODERS
    try:
        return [encoders[type(e)](e, session_id) for e in events]
    except (KeyError, struct.error):
        for e in events:
            encode_event(e, session_id)  # raises the typed error for the first bad one
        raise


class Scan(NamedTuple):
    """What the engine's log step needs of a batch of events before they are encoded:
    ``first_disk_move`` the index of the first move into the disk tier (-1: none), where
    the records start naming disk slots (a disk barrier starts there); ``blocks`` what a
    replay of their records decodes block by block, the checkpoint trigger's unit (counted
    alike by ``Replayer.blocks``): a stored run's hashes and tokens, the slots (and
    checksums) of a copy into host or disk, the hashes of a forgotten run. A move into the
    device or a drop that leaves a copy elsewhere names its run by its ends: one lookup,
    whatever its length (the record bound covers those)."""

    first_disk_move: int
    blocks: int


def scan_events(events) -> Scan:
    """``Scan`` of ``events`` (a loop over their types: no record is built)."""
    at = -1
    blocks = 0
    i = 0
    for e in events:
        t = type(e)
        if t is BlocksMoved:
            if e.tier != DEVICE:
                blocks += len(e.hashes)
                if at < 0 and e.tier == DISK:
                    at = i
        elif t is BlocksStored or (t is BlocksDropped and e.forgotten):
            blocks += len(e.hashes)
        i += 1
    return Scan(at, blocks)


# -- decoding ------------------------------------------------------------------------------------
#
# A raw value is ``kind u8 | fixed fields | blob | crc32c u32``; the blob starts at the kind's
# ``fixed_size``. The asserts tie the offsets below to the kinds table: a changed row fails at
# import, not as a misread log.

_CRC = CRC_SIZE
_RUN_BLOB = CODECS[Kind.BLOCK_MOVE].fixed_size
assert CODECS[Kind.BLOCK_MOVE].struct.format == CODECS[Kind.BLOCK_DROP].struct.format == "<BBI"
assert CODECS[Kind.BLOCK_PUT].struct.format == "<BBI"
assert CODECS[Kind.OPEN].struct.format == "<BQQII"
assert CODECS[Kind.COMMIT].struct.format == "<BQI"
assert CODECS[Kind.RELEASE].struct.format == "<BQ"
assert CODECS[Kind.FORK].struct.format == "<BQQI"
assert CODECS[Kind.RECOVER].struct.format == "<BIB"

_U32 = struct.Struct("<I").unpack_from
_SEQ_ID = struct.Struct("<Q").unpack_from  # the first field of OPEN, COMMIT, RELEASE, FORK
_OPEN_IDS = struct.Struct("<QQ").unpack_from
_FORK_FIELDS = struct.Struct("<QQI").unpack_from
_RECOVER_FIELDS = struct.Struct("<IB").unpack_from
_OPEN_BLOB = CODECS[Kind.OPEN].fixed_size
_COMMIT_BLOB = CODECS[Kind.COMMIT].fixed_size
_PUT_BLOB = CODECS[Kind.BLOCK_PUT].fixed_size

_unpackers: dict[tuple[str, int], object] = {}


def unpacker(code: str, n: int):
    """``unpack_from`` of ``n`` little-endian items of ``code`` (``I`` slots, ``Q`` checksums,
    ``16s`` hashes), cached per count."""
    s = _unpackers.get((code, n))
    if s is None:
        s = _unpackers[(code, n)] = struct.Struct("<" + code * n if code == "16s" else f"<{n}{code}").unpack_from
    return s


class RunOffsets(NamedTuple):
    """Where a BLOCK_MOVE / BLOCK_DROP value keeps each part (byte offsets into the value).

    ``tier`` u8 and ``num_blocks`` u32 (fixed fields), then the blob: ``first`` and ``last``
    hash (16 bytes each; ``name`` = ``first`` .. ``body`` is first || last), and from ``body``
    a move's slots (u32 each, none into the device tier) and its checksums (u64 each, only
    when present: the value is longer than ``body`` + slots + crc).

    NOTE: replay decodes moves and drops inline from these (they are most of a log and a
    function call per record showed in a 1M-block recovery); ``decode_run`` and
    ``decode_move`` read the same offsets for everyone else.
    """

    tier: int
    num_blocks: int
    first: int
    last: int
    body: int


RUN = RunOffsets(1, 2, _RUN_BLOB, _RUN_BLOB + H, _RUN_BLOB + 2 * H)


def decode_run(value) -> tuple[int, int, bytes, bytes]:
    """A move's or drop's ``(tier, num_blocks, first hash, last hash)``."""
    return value[RUN.tier], _U32(value, RUN.num_blocks)[0], value[RUN.first:RUN.last], value[RUN.last:RUN.body]


def decode_move(value) -> tuple[list[int] | None, list[int]]:
    """A BLOCK_MOVE's ``(slots, checksums)``: ``slots`` is ``None`` into the device (not
    logged), ``checksums`` empty when the move did not establish them."""
    tier, n = value[RUN.tier], _U32(value, RUN.num_blocks)[0]
    at = RUN.body
    slots = None
    if tier != DEVICE:
        slots = list(unpacker("I", n)(value, at))
        at += 4 * n
    sums = list(unpacker("Q", n)(value, at)) if len(value) > at + _CRC else []
    return slots, sums


def decode_put(value) -> tuple[bytes, list[bytes], bytes]:
    """A BLOCK_PUT's ``(parent hash, hashes, tokens)`` (its device slots are never needed)."""
    n = _U32(value, 2)[0]
    at = _PUT_BLOB + H
    end = len(value) - _CRC - 4 * n
    return value[_PUT_BLOB:at], list(unpacker("16s", n)(value, at)) if n else [], value[at + n * H:end]


def decode_open(value) -> tuple[int, int, bytes, bytes]:
    """An OPEN's ``(seq_id, session_id, deepest shared hash or b"", extra)``."""
    seq_id, session_id = _OPEN_IDS(value, 1)
    deepest = value[_OPEN_BLOB:_OPEN_BLOB + H]
    return seq_id, session_id, b"" if deepest == ZERO_HASH else deepest, value[_OPEN_BLOB + H:-_CRC]


def decode_commit(value) -> tuple[int, bytes]:
    """A COMMIT's ``(seq_id, hash of the sequence's last indexed block)``."""
    return _SEQ_ID(value, 1)[0], value[_COMMIT_BLOB:-_CRC]


def decode_seq_id(value) -> int:
    """The sequence id of an OPEN, COMMIT, RELEASE or FORK (its first field)."""
    return _SEQ_ID(value, 1)[0]


def decode_fork(value) -> tuple[int, int, int]:
    """A FORK's ``(parent seq_id, first child id, number of children)``."""
    return _FORK_FIELDS(value, 1)


def decode_recover(value) -> tuple[int, bool]:
    """A RECOVER's ``(epoch, host_kept)``."""
    epoch, kept = _RECOVER_FIELDS(value, 1)
    return epoch, bool(kept)


# NOTE (checkpoint trigger): a restart replays every record since the last checkpoint, and
# a record that brings per-block data costs replay per block (a BLOCK_PUT's hashes and
# tokens, the slots and checksums of a move into host or disk, the hashes of a forgotten
# run): with 12k-token prompts a 44k-record tail named 3.1M blocks and replayed in 2.3-3.0 s.
# So a checkpoint is due once the tail would make replay decode ``checkpoint_blocks`` blocks
# (``Scan.blocks``), or once it holds ``checkpoint_records`` records, whichever comes
# first; a replayed tail counts toward both until the next checkpoint. The default,
# ``CHECKPOINT_BLOCKS``, is about what the reference 100k-record tail of ``bench/recovery.py``
# decodes (so either bound alone costs a replay like the one that keeps a 1M-block restart
# within its 1.0 s target); its long-prompt case shows the tail bounded.
CHECKPOINT_BLOCKS = 500_000  # default bound on the blocks a replay of the tail decodes (NOTE above)
