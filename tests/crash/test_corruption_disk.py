"""Corruption table of the disk pool file: damage a closed state directory, reopen it, check what
is served.

One harness (``corruption_harness``), one table per file kind, as etcd's WAL tests do; this is
the table of the disk tier file (``<state_dir>/*.disk.pool``; ``test_corruption_lmdb`` holds the
log's). Every row names the damage; the harness builds the same state directory in-process (a
few prompts committed at ``power``, shm pools deleted afterwards as after a reboot, so the disk
tier is the only copy of the KV bytes), the row damages it, and the test reopens it with
``verify="lazy"`` and ``"eager"`` and checks the contract:

A block whose bytes were damaged is never served (``open`` cuts the match before it, and before
everything below it on disk); every undamaged block keeps serving with the right bytes;
``stats.corrupt_blocks`` is non-zero exactly when a damaged block was met. NOTE: the counter
counts detections (one per run cut), not blocks: the run's tail and its subtree are dropped
unread. With ``lazy``, ``lookup`` is an index query and may still count a damaged block until
the first ``open`` that reads it; with ``eager`` it never does. A damaged header is REFUSED at
open (``HeaderMismatchError`` naming the file), except truncation into the header's zero
padding, which leaves every field intact and is handled like any truncation (the file is
re-extended; the lost slots fail their checksums).
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import pytest

from prefixd.cache.node import DISK
from prefixd.storage.errors import HeaderMismatchError
from prefixd.storage.poolfile import DATA_OFFSET
from tests.crash.corruption_harness import (BS, PAGE, PROMPTS, SIZES, Built, build, flip_bit, open_cache,
                                           serve_all)
from tests.crash.prefixd_workload import verify_index

# -- damage to the disk tier file -------------------------------------------------------------------
# Each function damages the closed pool file and returns the slots whose bytes it changed.

def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def _write(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


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
        flip_bit(b.disk_path, b.offset(slot) + 1234)
        flip_bit(b.disk_path, b.offset(slot) + 5000, 0x01)
    return bad


def flip_bit_in_shared_block(b: Built) -> set[int]:
    slot = b.slots[1][0]  # shared by prompts 1 and 4: both lose everything from it on
    flip_bit(b.disk_path, b.offset(slot) + b.block_bytes - 1, 0x80)
    return {slot}


def flip_bit_in_header_field(b: Built) -> set[int]:
    flip_bit(b.disk_path, 30)  # inside num_slots / block_bytes: caught by the header hash
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


@pytest.mark.parametrize("verify", ["lazy", "eager"])
@pytest.mark.parametrize("row", DISK_TABLE, ids=[r.name for r in DISK_TABLE])
def test_damaged_disk_blocks_are_never_served_and_the_rest_keeps_serving(tmp_path, row, verify):
    """Guards against serving bytes from a damaged disk slot (or from below one), against losing
    undamaged prompts with it, and against a damaged pool header being trusted or refused without
    naming the file."""
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
        assert serve_all(dc) == want
        assert dc.cache.stats.corrupt_blocks >= 1
        assert [dc.lookup(t).cached_tokens // BS for t in PROMPTS] == want
        verify_index(dc)
        dc.check_invariants()
    finally:
        dc.close()
    dc = open_cache(b.state_dir, b.shm_dir, verify=verify)  # the cut was logged: it stays cut
    try:
        assert serve_all(dc) == want
        assert dc.cache.stats.corrupt_blocks == 0, "a block cut before the restart was read again"
        verify_index(dc)
        dc.check_invariants()
    finally:
        dc.close()


def test_undamaged_disk_pool_serves_every_prompt_from_disk_and_restarts_again(tmp_path):
    """The control row: without damage every prompt is a full hit from disk and nothing is counted
    corrupt (so the table's cuts come from the damage, not from the harness). Then a second
    restart on the same boot, which must open too: the host pool recreated after the reboot has
    a new file id, and a restart that does not know it refuses the pool (HeaderMismatchError on
    the host pool's file id)."""
    b = build(tmp_path)
    dc = open_cache(b.state_dir, b.shm_dir, verify="eager")
    try:
        assert serve_all(dc) == [len(s) for s in b.slots]
        assert dc.cache.stats.corrupt_blocks == 0
        assert dc.cache.stats.hit_tokens_by_tier[DISK] > 0
    finally:
        dc.close()
    dc = open_cache(b.state_dir, b.shm_dir)
    try:
        assert dc.recovery["keep_host"] is True
        assert serve_all(dc) == [len(s) for s in b.slots]
    finally:
        dc.close()
