"""A prefixd workload for crash tests: run it in a child, kill it, recover, check.

    python -m tests.crash.prefixd_workload STATE_DIR SHM_DIR ACK_LOG [--seed N]
        [--durability crash|power] [--sync commit|interval|none] [--requests N]
        [--concurrent N] [--plant ack-before-commit|ack-before-ticket]

The child opens (recovering) a ``DurableCache`` on STATE_DIR, then serves random requests:
prompts share a few system prefixes, KV is written as values derived from each token's whole
prefix (``StoreTokens``), commits are acknowledged in ACK_LOG *after* ``commit`` returned
(one line: durability, then the committed tokens as hex int32). Some requests fork, some
release without committing, some extend twice; a checkpoint falls every few hundred records.
Pools are small on the device and host so that every run evicts, demotes and promotes; the disk
is large enough that nothing committed is ever forgotten, so after any crash every acknowledged
commit must still be a hit.

With ``--concurrent N`` the child keeps N sequences in flight on its one thread, as a daemon
would: each is opened, written and committed, and its commit's ticket is left running; a
commit is acknowledged (and its sequence released, and the lane's next request started) only
when its ticket has resolved. Pools are bigger there (``CONCURRENT_SIZES``: N sequences are
pinned at once) and ``check`` must be given the same sizes.

With ``--wide`` the blocks are 64 KiB (``WIDE``: 32 to a pool file's 2 MiB extent) and the
pools ``WIDE_SIZES``, so the sparse pool files grow extent by extent; every ``WIDE_EVICT_EVERY``
requests the device and host tiers are emptied (demoting down to disk) and every tier's idle
extents punched (``TierStore.shrink``, as a cross-pool evictor does), so extents are grown,
emptied and punched all along. ``check`` must then be given ``layout=WIDE, sizes=WIDE_SIZES``.

``check(state_dir, shm_dir, acks)`` (used by the parent) recovers the cache and checks: every
acknowledged commit is a hit on all of its whole blocks; every block in the index holds exactly
the bytes its prefix implies (so nothing half-applied is ever served); invariants hold.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import sys

import numpy as np

from prefixd.api.layout import KVLayout
from prefixd.engine.durable import DurableCache
from prefixd.cache.node import DEVICE, DISK, HOST, path_to
from prefixd.api.tiers import Tier
from tests.cache.helpers import StoreTokens

BS = 4
LAYOUT = KVLayout("crash-test", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=BS)
SIZES = (24, 24, 65536)  # disk: room for every commit of a 200-kill soak (~8k blocks)
CONCURRENT_SIZES = (160, 48, 65536)  # device: 16 sequences of up to 6 blocks pinned, and eviction
WIDE = KVLayout("crash-test-wide", num_layers=1, num_kv_heads=1, head_dim=2048, dtype="float32",
                block_size=BS)  # 64 KiB blocks
WIDE_SIZES = (96, 96, 4096)  # 6, 6 and 256 MiB files: 3, 3 and 128 extents
WIDE_EVICT_EVERY = 10


def open_cache(state_dir: str, shm_dir: str, sizes=SIZES, layout=LAYOUT, **kw) -> DurableCache:
    kw.setdefault("checkpoint_records", 300)
    kw.setdefault("spill_blocks", 8)
    kw.setdefault("reclaim_grace_s", 0.0)
    return DurableCache(state_dir, layout, sizes, shm_dir=shm_dir, **kw)


def empty_memory_tiers(dc: DurableCache) -> None:
    """``--wide``: evict every unpinned block of the device and host (down to disk), log it,
    and punch every idle extent once the quarantine lets its slots go."""
    dc.cache.evict(1 << 30, DEVICE)
    dc.cache.evict(1 << 30, HOST)
    dc.tick()
    for tier in Tier:
        dc.store.shrink(tier)


def run(args) -> None:
    from tests.crash.acklog import AckLog

    rng = random.Random(args.seed)
    if args.wide:
        dc = open_cache(args.state_dir, args.shm_dir, WIDE_SIZES, WIDE, sync=args.sync)
    else:
        dc = open_cache(args.state_dir, args.shm_dir, CONCURRENT_SIZES if args.concurrent else SIZES,
                        sync=args.sync)
    dc.expire_recovered()
    pool = StoreTokens(dc.store, BS)
    acks = AckLog(args.acks)
    systems = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(6)]
    if args.concurrent:
        run_concurrent(args, dc, pool, acks, rng, systems)
        dc.close()
        return
    for i in range(args.requests):
        seq, tokens = _open_request(dc, pool, rng, systems, p_extend=0.7)
        if rng.random() < 0.15:
            kids = dc.fork(seq.id, 2)
            for kid in kids:
                dc.release(kid.id)
        if rng.random() < 0.1:
            dc.release(seq.id)  # abandoned: never acknowledged
            continue
        line = ack_line(args.durability, tokens)
        if args.plant == "ack-before-commit" and line:
            acks.ack(line)  # planted bug: acknowledged before anything is durable
            dc.commit(seq.id, "index").result()
        else:
            dc.commit(seq.id, args.durability).result()
            if line:
                acks.ack(line)
        dc.release(seq.id)
        if i % 50 == 49:
            dc.tick()
        if args.wide and i % WIDE_EVICT_EVERY == WIDE_EVICT_EVERY - 1:
            empty_memory_tiers(dc)
    dc.close()


def _open_request(dc: DurableCache, pool: StoreTokens, rng: random.Random, systems: list[list[int]],
                 p_extend: float):
    """Open a random prompt (a system prefix and 1 to 9 tokens) and write its KV; with
    probability ``p_extend``, extend it by 1 to 6 tokens and write theirs. Returns the sequence
    and all its tokens."""
    tokens = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
    seq = dc.open(tokens)
    pool.write(seq.block_table, tokens, seq.cached_tokens)
    if rng.random() < p_extend:
        more = [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
        dc.extend(seq.id, more)
        tokens += more
        pool.write(dc.sequence(seq.id).block_table, tokens, len(tokens) - len(more))
    return seq, tokens


def ack_line(durability: str, tokens: list[int]) -> str | None:
    """The ACK_LOG line of a commit: its durability and its whole blocks' tokens as hex int32
    (None when no block is whole: nothing to acknowledge)."""
    full = len(tokens) // BS * BS
    return f"{durability} {np.asarray(tokens[:full], '<i4').tobytes().hex()}" if full else None


def run_concurrent(args, dc, pool, acks, rng, systems) -> None:
    """``args.concurrent`` sequences in flight; an ack only once its commit's ticket resolved."""
    resolved: queue.SimpleQueue = queue.SimpleQueue()
    live: dict[int, tuple] = {}  # seq id -> (ticket, ack line or None)
    started = 0

    def start() -> None:
        nonlocal started
        while started < args.requests:
            started += 1
            seq, tokens = _open_request(dc, pool, rng, systems, p_extend=0.5)
            if rng.random() < 0.1:
                dc.release(seq.id)  # abandoned: never acknowledged
                continue
            line = ack_line(args.durability, tokens)
            ticket = dc.commit(seq.id, args.durability)
            if args.plant == "ack-before-ticket" and line:
                acks.ack(line)  # planted bug: acknowledged before the ticket resolved
                line = None
            live[seq.id] = (ticket, line)
            ticket.add_done_callback(lambda _f, sid=seq.id: resolved.put(sid))
            return

    for _ in range(args.concurrent):
        start()
    done = 0
    while live:
        seq_id = resolved.get()
        ticket, line = live.pop(seq_id)
        ticket.result()  # a failed commit ends the child: nothing more is acknowledged
        if line:
            acks.ack(line)
        dc.release(seq_id)
        done += 1
        if done % 50 == 0:
            dc.tick()
        start()


def check(state_dir: str, shm_dir: str, acks: list[str], *, sync: str = "commit",
          sizes=SIZES, layout=LAYOUT) -> dict:
    """Recover and check; returns counts (acks checked, blocks verified, and ``taken``: the
    bytes of each tier's pool file, ``st_blocks`` after recovery, against ``charged``)."""
    dc = open_cache(state_dir, shm_dir, sizes, layout, sync=sync)
    try:
        disk = dc.cache.allocators[DISK]
        assert disk.num_free > disk.num_slots // 10, (
            "test premise broken: the workload nearly filled the disk tier, so evictions may have "
            "forgotten acknowledged commits legitimately; give SIZES a bigger disk")
        dc.check_invariants()
        verified = verify_index(dc)
        pool = StoreTokens(dc.store, BS)
        dc.expire_recovered()
        checked = 0
        for line in acks:
            _, hexed = line.split()
            tokens = np.frombuffer(bytes.fromhex(hexed), "<i4").tolist()
            seq = dc.open(tokens + [0])
            assert seq.cached_tokens == len(tokens), \
                f"acknowledged commit lost: {len(tokens)} tokens committed, {seq.cached_tokens} cached"
            pool.check(seq.block_table[: len(tokens) // BS], tokens)
            dc.release(seq.id)
            checked += 1
        dc.check_invariants()
        files = {t.name: dc.store.pool(t).path for t in Tier}
        return {"acks": checked, "blocks_verified": verified, "recovery": dc.recovery,
                "taken": {n: os.stat(p).st_blocks * 512 for n, p in files.items()},
                "charged": {t.name: dc.store.held_bytes(t) for t in Tier}}
    finally:
        dc.close()


def verify_index(dc: DurableCache, values=StoreTokens.values, what: str = "the index") -> int:
    """Every block of the index, in every tier it is in (host and disk; a disk block passes its
    checksum too), holds its prefix's bytes: ``values(prefix tokens)``, one value per token, in
    every layer, K and V, head and dim of its position (as `StoreTokens` writes them).

    Args:
        values: the values of a prompt's tokens (`StoreTokens.values`, or a pool's own).
        what: names the cache in a failure (``pool 2``).

    Returns:
        The blocks checked (a block in two tiers counts twice).
    """
    store = dc.store
    bs = dc.layout.block_size
    n = 0
    for node in list(dc.cache.tree.nodes()):
        tokens = np.frombuffer(b"".join(p.tokens for p in path_to(node)), "<i4").tolist()
        want = np.asarray(values(tokens)[-node.num_blocks * bs:], dtype=np.float32)
        want = want.reshape(node.num_blocks, 1, 1, bs, 1, 1)  # [n, layers, K/V, bs, heads, dims]
        for tier in (HOST, DISK):
            slots = node.slots[tier]
            if slots is None:
                continue
            if tier == DISK:
                ok = store.verify(Tier.DISK, slots, node.checksums)
                assert all(ok), f"{what}: a disk block in the index fails its checksum: {ok}"
            got = store.read(Tier(tier), slots).numpy()
            assert (got == want).all(), \
                f"{what}: wrong bytes in tier {tier} for a run of {node.num_blocks} blocks"
            n += node.num_blocks
        assert node.slots[DEVICE] is None or dc.cache.device is not None
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("state_dir")
    ap.add_argument("shm_dir")
    ap.add_argument("acks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--durability", default="crash", choices=("crash", "power"))
    ap.add_argument("--sync", default="commit")
    ap.add_argument("--requests", type=int, default=10**9)
    ap.add_argument("--concurrent", type=int, default=0, help="sequences in flight (0: one at a time)")
    ap.add_argument("--wide", action="store_true", help="64 KiB blocks; empty the memory tiers often")
    ap.add_argument("--plant", default="", choices=("", "ack-before-commit", "ack-before-ticket"),
                    help="a planted bug, to show that a crash test catches it")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
