"""The ZMQ KV events' packing and lineage, in process: each event's bytes equal msgpack of the
dict vLLM's msgspec structs make (fields in declaration order, defaults omitted, the tag first),
and a tier copy or a drop says of its blocks what their run said at its store (the whole run's
packed pieces reused as they are, a slice's parent and token ids cut from the run, an unknown
or forgotten run's hashes alone)."""

from __future__ import annotations

import msgpack
import numpy as np

from prefixd.daemon.kv_lineage import Lineage
from prefixd.daemon.kv_wire import MEDIUMS, Batch, ExternalHashes

BS = 4


def _run(seed: int, blocks: int):
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(16) for _ in range(blocks)]
    tokens = rng.integers(0, 50000, blocks * BS, dtype="<i4")
    return hashes, tokens


def _events(*adds) -> list[dict]:
    batch = Batch()
    for add in adds:
        add(batch)
    ts, events, rank = msgpack.unpackb(batch.encode(ts=1.5), raw=False)
    assert (ts, rank) == (1.5, None)
    assert len(events) == batch.num_events
    return events


def _stored(hashes, parent, token_ids, medium) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": BS, "lora_id": None, "medium": medium,
            "lora_name": None}


def test_events_are_msgpack_of_vllms_structs():
    ext = ExternalHashes("alpha")
    lineage = Lineage(ext)
    hashes, tokens = _run(0, 3)
    run = lineage.add(hashes, 12345, tokens.tobytes(), BS)
    batch = Batch()
    batch.cleared()
    batch.stored(run.fields, "GPU")
    batch.removed(run.packed, "DISK")
    want = [{"type": "AllBlocksCleared"}, _stored(ext.many(hashes), 12345, tokens.tolist(), "GPU"),
            {"type": "BlockRemoved", "block_hashes": ext.many(hashes), "medium": "DISK"}]
    assert batch.encode(ts=2.25) == msgpack.packb([2.25, want, None], use_bin_type=True)
    assert MEDIUMS == ("GPU", "CPU", "DISK")


def test_copy_of_a_whole_run_reuses_its_packed_fields():
    lineage = Lineage(ExternalHashes("alpha"))
    hashes, tokens = _run(1, 4)
    run = lineage.add(hashes, None, tokens.tobytes(), BS)
    assert lineage.fields(list(hashes), BS) is run.fields  # an equal list, not the same one
    assert lineage.packed(list(hashes)) is run.packed


def test_copy_of_a_slice_has_the_runs_parent_and_tokens():
    ext = ExternalHashes("alpha")
    lineage = Lineage(ext)
    hashes, tokens = _run(2, 5)
    lineage.add(hashes, 777, tokens.tobytes(), BS)
    mid, first = hashes[2:4], hashes[:2]
    got = _events(lambda b: b.stored(lineage.fields(mid, BS), "CPU"),
                  lambda b: b.stored(lineage.fields(first, BS), "DISK"),
                  lambda b: b.removed(lineage.packed(mid), "GPU"))
    parent = ext.one(hashes[1])
    assert got == [_stored(ext.many(mid), parent, tokens[2 * BS:4 * BS].tolist(), "CPU"),
                   _stored(ext.many(first), 777, tokens[:2 * BS].tolist(), "DISK"),
                   {"type": "BlockRemoved", "block_hashes": ext.many(mid), "medium": "GPU"}]


def test_unknown_or_forgotten_blocks_go_out_as_hashes_alone():
    """A copy of blocks no run indexed (or a run's blocks out of order) carries no parent and no
    token ids, as vLLM's offloading connector's placeholder stores do."""
    ext = ExternalHashes("alpha")
    lineage = Lineage(ext)
    hashes, tokens = _run(3, 3)
    lineage.add(hashes, None, tokens.tobytes(), BS)
    other, _ = _run(4, 2)
    shuffled = [hashes[1], hashes[0]]
    lineage.forget(hashes[2:])
    assert len(lineage) == 2
    got = _events(lambda b: b.stored(lineage.fields(other, BS), "CPU"),
                  lambda b: b.stored(lineage.fields(shuffled, BS), "CPU"),
                  lambda b: b.stored(lineage.fields(hashes[2:], BS), "DISK"),
                  lambda b: b.removed(lineage.packed(hashes[2:]), "DISK"))
    assert got == [_stored(ext.many(other), None, [], "CPU"),
                   _stored(ext.many(shuffled), None, [], "CPU"),
                   _stored(ext.many(hashes[2:]), None, [], "DISK"),
                   {"type": "BlockRemoved", "block_hashes": ext.many(hashes[2:]), "medium": "DISK"}]


def test_tenants_hashes_differ_and_long_runs_convert_alike():
    """``many`` takes numpy past 12 blocks; both ways give ``one`` of each block."""
    hashes, _ = _run(5, 40)
    a, b = ExternalHashes("alpha"), ExternalHashes("beta")
    assert a.many(hashes) == [a.one(h) for h in hashes]
    assert a.many(hashes[:5]) == [a.one(h) for h in hashes[:5]]
    assert not set(a.many(hashes)) & set(b.many(hashes))
