"""A checkpoint taken in parts (``prefixd.engine.checkpointer``): the picture on the engine's
thread, its bytes and the log write later, the engine serving in between (as the daemon runs
it, ``prefixd.daemon.offloop``)."""

from __future__ import annotations

import random

import pytest

from prefixd.cache.node import DISK, HOST
from prefixd.engine import checkpoint as ckpt
from prefixd.engine.checkpointer import Picture
from prefixd.wal.checkpoint_store import CHUNK_SIZE, _chunks
from tests.cache.helpers import StoreTokens, tiny_layout
from tests.engine.factory import cache_factory

BS = 2
LAYOUT = tiny_layout(BS)


@pytest.fixture
def make(tmp_path):
    with cache_factory(tmp_path, LAYOUT, (8, 12, 64), checkpoint_records=10**9) as make:
        yield make


def serve(dc, tokens, durability="crash", release=True):
    seq = dc.open(tokens)
    StoreTokens(dc.store, BS).write(seq.block_table, tokens, seq.cached_tokens)
    dc.commit(seq.id, durability).result()
    if release:
        dc.release(seq.id)
    return seq


def prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing prefixes (runs split), longer than the device tier (evictions)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            for _ in range(n)]


def state(dc, asked) -> dict:
    """What the cache holds, as a restart must rebuild it (device residency does not survive
    one, and a disk hit is unverified until read): per prompt the tokens matched, and the
    blocks on the host and the disk."""
    matched = {tuple(p): dc.lookup(p) for p in asked}
    return {"matched": {p: r.cached_tokens + r.unverified_tokens for p, r in matched.items()},
            "blocks": tuple(dc.cache.tree.num_blocks_in[1:])}


def test_the_pictures_values_are_the_bytes_of_a_dump(make):
    dc = make()
    for p in prompts(1, 40):
        serve(dc, p, "power" if p[0] % 2 else "crash")
    held = serve(dc, prompts(2, 1)[0], release=False)  # a live sequence is in ``seqs``
    dc.close()
    dc = make()  # a loaded tree: packed runs
    for i, node in enumerate(dc.cache.tree.nodes()):
        if i % 2 and node.parent is not None:
            node.hashes, node.checksums  # noqa: B018 - unpacks half of them
    assert any(n.slots[DISK] for n in dc.cache.tree.nodes())
    assert any(n.slots[HOST] for n in dc.cache.tree.nodes())
    want_index, want_seqs = ckpt.dump_engine(dc.cache, dc._sessions, dc.recovered.values(),
                                             dc.store.file_ids)
    index, seqs = Picture.take(dc.cache, dc._sessions, dc.recovered.values(),
                               dc.store.file_ids, 0).values()
    assert seqs == want_seqs and held.id in {s[0] for s in ckpt.msgpack.unpackb(seqs[b"seqs"])}
    assert {k: ckpt.whole(v) for k, v in index.items()} == want_index


def test_a_checkpoint_written_while_the_engine_served_on_restores_the_state_at_the_end(make):
    """The picture is taken, then the engine serves (runs split, evicted, dropped, new ones
    committed), then its bytes are made and written: the checkpoint holds the state at its
    lsn, the log after it holds the rest, a restart rebuilds the state at the end."""
    dc = make()
    asked = prompts(3, 60)
    for p in asked[:20]:
        serve(dc, p)
    picture = dc.upkeep.begin_checkpoint()
    before = state(dc, asked)
    for p in asked[20:50]:  # the engine serves on: the picture must not see any of it
        serve(dc, p, "power" if p[-1] % 3 == 0 else "crash")
    assert state(dc, asked) != before
    index, seqs = picture.values()
    dc.upkeep.submit_checkpoint(picture, index, seqs).result()
    dc.upkeep.end_checkpoint(picture)
    for p in asked[50:]:
        serve(dc, p)
    want = state(dc, asked)
    dc.check_invariants()
    dc.close()
    dc = make()
    assert state(dc, asked) == want
    dc.check_invariants()
    dc.checkpoint()  # and a checkpoint of the recovered state restores it too
    dc.close()
    dc = make()
    assert state(dc, asked) == want


def test_values_given_as_chunks_are_stored_as_the_joined_value_and_bad_chunks_refused():
    value = bytes(range(256)) * (CHUNK_SIZE // 128 + 3)
    joined = [bytes(c) for c in _chunks(b"k", value)]
    given = [value[a:a + CHUNK_SIZE] for a in range(0, len(value), CHUNK_SIZE)]
    assert [bytes(c) for c in _chunks(b"k", given)] == joined and len(joined) == 3
    assert [bytes(c) for c in _chunks(b"k", [b""])] == [b""] == [bytes(c) for c in _chunks(b"k", b"")]
    for bad in ([b"x" * 10, b"y"], [b"x" * CHUNK_SIZE, b""], [b"x" * (CHUNK_SIZE + 1)], []):
        with pytest.raises(ValueError, match="chunks of"):
            _chunks(b"k", bad)
