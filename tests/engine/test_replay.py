"""Replay against the live index: what a restart rebuilds is what was there, minus the device.

The differential check: random traffic (shared prefixes cut at random points, so matches end
inside runs and split them; pools small enough that every tier evicts; explicit evictions of
partial runs; checkpoints at random moments; forks; sequences left open) runs on a
``DurableCache``; then the live index, with device residency taken away as reconciliation
does, must equal the index a fresh process rebuilds from the checkpoint and the log tail:
the same runs (the same node boundaries), the same host and disk slots, tokens and checksums
per block, and the same eviction order; and every sequence left open must come back at the
deepest block of its path that had a host or disk copy (a lost COMMIT record brought one back
at its open's match: ``tests/engine/test_commit_forces_reclaim.py``).
"""

from __future__ import annotations

import os
import random

import msgpack
import pytest

from prefixd.engine import checkpoint as ckpt
from prefixd.engine import DurabilityError, DurableCache
from prefixd.cache.errors import OutOfBlocks
from prefixd.engine.errors import StateFormatError
from prefixd.cache.node import DEVICE, DISK, HOST, path_to
from prefixd.cache.prefix_cache import PrefixCache
from prefixd.engine.replay import ReplayError, Replayer
from prefixd.wal import Kind, Record, Wal
from prefixd.wal.datafile import newest_meta
from tests.cache.helpers import tiny_layout, toks

BS = 2
LAYOUT = tiny_layout(BS)
SIZES = (40, 24, 64)


def _open(tmp_path, **kw) -> DurableCache:
    shm = str(tmp_path / "shm")
    os.makedirs(shm, exist_ok=True)
    return DurableCache(str(tmp_path / "state"), LAYOUT, SIZES, shm_dir=shm, **kw)


def _survivors(tree) -> dict:
    """Runs that survive a restart, by (first hash, last hash): host/disk slots, tokens, sums."""
    out = {}
    for node in tree.nodes():
        host, disk = node.slots[HOST], node.slots[DISK]
        if host is None and disk is None:
            continue  # device only: reconciliation forgets it
        out[(node.hashes[0], node.hashes[-1])] = (
            node.tokens, host, disk, node.checksums if disk is not None else None)
    return out


def _surviving_seqs(dc: DurableCache) -> dict:
    """Live sequences as a restart must bring them back: seq id -> tokens on the path to the
    deepest node of theirs with a host or disk copy (lower tiers stay root-anchored)."""
    out = {}
    for seq in dc.cache.sequences():
        node = seq.node
        while node.parent is not None and node.slots[HOST] is None and node.slots[DISK] is None:
            node = node.parent
        out[seq.id] = _path_tokens(node)
    return out


def _path_tokens(node) -> bytes:
    return b"".join(n.tokens for n in path_to(node))


def _eviction_order(tree, tier: int) -> list[bytes]:
    """Last hashes of the runs ``tier``'s queue would evict, in order (queue left empty)."""
    order = []
    while (node := tree.queues[tier].pop()) is not None:
        order.append(node.hashes[-1])
    return order


def _traffic(dc: DurableCache, rng: random.Random, steps: int, checkpoints: bool = True) -> list[int]:
    """Random traffic; returns the ids of sequences left open."""
    bases = [[rng.randrange(1000) for _ in range(24)] for _ in range(4)]
    live: list[int] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.65 or not live:
            base = rng.choice(bases)
            prompt = base[: rng.randrange(1, len(base))] + [rng.randrange(1000) for _ in range(rng.randrange(0, 7))]
            if len(prompt) < 2:
                prompt.append(7)
            try:
                seq = dc.open(prompt)
            except OutOfBlocks:  # the live sequences hold the device: a legitimate refusal
                continue
            try:
                dc.commit(seq.id, rng.choice(("index", "crash"))).result()
            except DurabilityError:  # the host tier is full of quarantined slots: still indexed
                pass
            if rng.random() < 0.15 and len(live) < 2:
                live.append(seq.id)
            else:
                dc.release(seq.id)
        elif r < 0.75:
            tier = rng.choice((DEVICE, HOST, DISK))
            dc.cache.evict(rng.randrange(1, 5), tier)
            dc._log()
        elif r < 0.8 and live:
            children = dc.fork(rng.choice(live), 2)
            for child in children:
                dc.release(child.id)
        elif r < 0.85 and checkpoints:
            dc.checkpoint()
        elif live:
            dc.release(live.pop(rng.randrange(len(live))))
    return live


@pytest.mark.parametrize("seed", range(12))
def test_a_restart_rebuilds_the_live_index_without_the_device(tmp_path, seed):
    rng = random.Random(seed)
    dc = _open(tmp_path, checkpoint_records=10**9)
    live = _traffic(dc, rng, 160, checkpoints=bool(seed % 2))  # even seeds: the whole history is a tail
    dc.wal.flush().result()
    dc.cache.check_invariants()
    want = _survivors(dc.cache.tree)
    want_seqs = _surviving_seqs(dc)
    assert set(live) <= set(want_seqs)
    tree = dc.cache.tree
    tree.rebuild_queues()
    dc.close()
    assert want, "the traffic left nothing on host or disk: the check would be empty"

    dc = _open(tmp_path)
    if seed % 2 == 0:
        assert dc.recovery["records_replayed"] > 500, dc.recovery
    got = _survivors(dc.cache.tree)
    assert got.keys() == want.keys(), "runs differ: replay split (or did not split) differently"
    for key, value in want.items():
        assert got[key] == value, f"run {key[0].hex()}..: {got[key]} != {value}"
    assert dc.cache.tree.num_blocks_in[DEVICE] == 0
    got_seqs = {r.seq_id: _path_tokens(r.node) for r in dc.recovered.values()}
    assert got_seqs == want_seqs, "a sequence left open came back elsewhere than its committed blocks"
    dc.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_restarts_in_the_tail_replay_as_they_happened(tmp_path, seed):
    """A tail holding several restarts (RECOVER records), some after a reboot (the host pool
    gone): replaying each restart's reconciliation must rebuild the index the last process
    had, with sequences left open across restarts."""
    rng = random.Random(1000 + seed)
    dc = _open(tmp_path, checkpoint_records=10**9)
    for restart in range(4):
        _traffic(dc, rng, 60, checkpoints=bool(seed % 2) and restart == 1)
        dc.close()
        if rng.random() < 0.4:  # as after a reboot: the host pool is gone
            for name in os.listdir(tmp_path / "shm"):
                if name.endswith(".host.pool"):
                    os.unlink(tmp_path / "shm" / name)
        dc = _open(tmp_path, checkpoint_records=10**9)
        assert dc.recovery["device_runs_missed"] == 0
    _traffic(dc, rng, 60, checkpoints=False)
    dc.wal.flush().result()
    want = _survivors(dc.cache.tree)
    dc.close()
    assert want, "the traffic left nothing on host or disk: the check would be empty"

    dc = _open(tmp_path)
    got = _survivors(dc.cache.tree)
    assert got.keys() == want.keys(), "runs differ after replaying the restarts"
    for key, value in want.items():
        assert got[key] == value, f"run {key[0].hex()}..: {got[key]} != {value}"
    dc.check_invariants()


def test_eviction_order_is_the_same_after_replay(tmp_path):
    """The log tail (not only the checkpoint) restores last access: reopened prefixes move back."""
    rng = random.Random(99)
    dc = _open(tmp_path, checkpoint_records=10**9)
    _traffic(dc, rng, 80)
    dc.checkpoint()
    for _ in range(6):  # touch some cached prefixes after the checkpoint: only the log has it
        node = rng.choice([n for n in dc.cache.tree.nodes() if n.slots[DISK] is not None])
        tokens = b"".join(n.tokens for n in reversed([node, *_ancestors(node)]))
        seq = dc.open(list(memoryview(tokens).cast("i")) + [5])
        dc.release(seq.id)
    dc.wal.flush().result()
    live_tree = dc.cache.tree
    live_tree.rebuild_queues()
    want = [h for h in _eviction_order(live_tree, DISK) if _resident_after_restart(live_tree, h)]
    dc.close()
    dc = _open(tmp_path)
    dc.expire_recovered()
    got = _eviction_order(dc.cache.tree, DISK)
    assert got == want


def _ancestors(node):
    out = []
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
        out.append(node)
    return out


def _resident_after_restart(tree, last_hash) -> bool:
    return any(n.hashes[-1] == last_hash and (n.slots[HOST] or n.slots[DISK]) for n in tree.nodes())


def _sizes(state) -> list:
    """Every file's size, LMDB's data file by the pages in use (an open pads the file past its
    last page with zeros: ``prefixd.wal.datafile``)."""
    out = []
    for p in state.rglob("*"):
        if p.is_file():
            meta = newest_meta(str(p)) if p.name == "data.mdb" else None
            out.append((p.name, p.stat().st_size if meta is None else (meta[1] + 1) * meta[2]))
    return sorted(out)


def test_a_state_dir_of_another_record_format_is_refused_untouched(tmp_path):
    dc = _open(tmp_path)
    seq = dc.open([1, 2, 3, 4, 5])
    dc.commit(seq.id, "crash").result()
    dc.release(seq.id)
    # rewrite the checkpoint's meta as format 1 wrote it (no records_version)
    lsn, index, seqs = dc.wal.load_checkpoint()
    meta = msgpack.unpackb(index[b"meta"])
    del meta["records_version"]
    index[b"meta"] = msgpack.packb(meta)
    dc.wal.checkpoint(lsn, index, seqs)
    dc.close()
    state = tmp_path / "state"
    before = _sizes(state)
    with pytest.raises(StateFormatError, match=f"format 1, this build reads format {ckpt.RECORDS_VERSION}"):
        _open(tmp_path)
    assert _sizes(state) == before
    meta["records_version"] = ckpt.RECORDS_VERSION  # the same directory opens once it says 2
    index[b"meta"] = msgpack.packb(meta)
    wal = Wal(str(state), layouts=None)
    wal.checkpoint(lsn, index, seqs)
    wal.close()
    dc = _open(tmp_path)
    assert dc.lookup([1, 2, 3, 4, 5]).cached_tokens == 4
    dc.close()


def test_a_record_naming_a_run_that_is_not_one_node_is_an_error(tmp_path):
    dc = _open(tmp_path)
    for first in (1, 2):
        seq = dc.open([first, 2, 3, 4, 5, 6, 7])
        dc.commit(seq.id, "crash").result()
        dc.release(seq.id)
    nodes = [n for n in dc.cache.tree.nodes()]
    a, b = nodes[0], nodes[1]
    replayer = Replayer(dc.cache.tree, {}, dc.cache.block_bytes)
    with pytest.raises(ReplayError, match="not one run"):  # first of one run, last of another
        replayer.apply(Record(1, Kind.BLOCK_DROP, (DISK, a.num_blocks), a.hashes[0] + b.hashes[-1]))
    with pytest.raises(ReplayError, match="not in the index"):
        replayer.apply(Record(2, Kind.BLOCK_DROP, (DISK, 1), b"\x01" * 32))
    with pytest.raises(ReplayError, match="does not fit its kind"):  # checksums cut short
        replayer.apply(Record(3, Kind.BLOCK_MOVE, (DISK if a.slots[DISK] is None else HOST, a.num_blocks),
                              a.hashes[0] + a.hashes[-1] + b"\x00" * (4 * a.num_blocks + 8)))
    tier = HOST if a.slots[HOST] is not None else DISK
    assert a.slots[tier] is not None
    with pytest.raises(ReplayError, match="already resident"):
        replayer.apply(Record(3, Kind.BLOCK_MOVE, (tier, a.num_blocks),
                              a.hashes[0] + a.hashes[-1] + b"\x00" * 4 * a.num_blocks))
    dc.close()


def test_a_restart_forgets_device_only_runs_deepest_first():
    """Device-only runs under a device-only run: the children go first (a parent resident
    nowhere with children trips the tree's invariant); a run also on disk stays, off the device."""
    import numpy as np

    cache = PrefixCache((32, 16, 64), 4, write_policy="write_back")  # commits stay on the device
    for prompt in ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 13, 14, 15, 16, 17), (50, 51, 52, 53, 54)):
        seq = cache.open(toks(*prompt))
        cache.commit(seq.id)
        cache.release(seq.id)
    tree = cache.tree
    nodes = list(tree.nodes())
    shared = next(n for n in nodes if n.children)
    kept = next(n for n in nodes if n.tokens[:4] == toks(50)[:4])
    assert len(shared.children) == 2 and tree.num_blocks_in == [4, 0, 0]
    tree.place(kept, DISK, list(range(kept.num_blocks)))  # as if written down (slots by hand)
    replayer = Replayer(tree, {}, cache.block_bytes)
    # as from a checkpoint: parents listed first, the order a restart must not drop in
    hashes = b"".join(h for n in nodes for h in n.hashes)
    replayer.use_checkpoint(nodes, np.frombuffer(hashes, "<u8")[0::2])  # first 8 bytes of each, as load gives
    replayer.restart(keep_host=True)
    assert tree.num_blocks_in[DEVICE] == 0 and replayer.device_runs_missed == 0
    assert list(tree.nodes()) == [kept] and kept.slots[DEVICE] is None and kept.slots[DISK] is not None
