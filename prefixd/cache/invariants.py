"""``check_invariants`` for the cache core: slow, thorough, for tests only."""

from __future__ import annotations

from collections import Counter

from prefixd.cache.hashing import chain_hashes
from prefixd.cache.node import DEVICE, NUM_TIERS, path_to


def check_tree(tree) -> dict:
    """Check every node; returns ``{id(node): node}`` of the reachable non-root nodes."""
    bb = tree.block_bytes
    seen = {}
    resident = [0] * NUM_TIERS
    for extra, root in tree.roots.items():
        assert root.parent is None and root.num_blocks == 0
        stack = [root]
        while stack:
            parent = stack.pop()
            kids_in = [0] * NUM_TIERS
            for key, node in parent.children.items():
                assert node.parent is parent, "child's parent link is wrong"
                assert key == node.key == node.tokens[:bb], "child keyed by a block it does not start with"
                assert node.num_blocks >= 1 and len(node.tokens) == node.num_blocks * bb
                assert node.hashes == chain_hashes(parent.hashes[-1], node.tokens, bb), \
                    "block hashes are not chained on the parent"
                assert any(s is not None for s in node.slots), "a node is resident nowhere"
                for t in range(NUM_TIERS):
                    if node.slots[t] is not None:
                        assert len(node.slots[t]) == node.num_blocks
                        assert parent.parent is None or parent.slots[t] is not None, \
                            f"tier {t} holds a block whose parent it lacks"
                        kids_in[t] += 1
                        resident[t] += node.num_blocks
                if node.checksums is not None:
                    assert len(node.checksums) == node.num_blocks
                assert not node.disk_verified or node.slots[2] is not None, \
                    "a run not on disk is marked disk-verified"
                seen[id(node)] = node
                stack.append(node)
            assert kids_in == parent.kids_in, f"kids_in {parent.kids_in} != actual {kids_in}"
    assert resident == tree.num_blocks_in, f"num_blocks_in {tree.num_blocks_in} != {resident}"
    assert all(n.lock_ref > 0 and n.parent is not None for n in tree.locked), "an unlocked node in tree.locked"
    assert all(n in tree.locked for n in seen.values() if n.lock_ref), "a locked node missing from tree.locked"
    for t, queue in enumerate(tree.queues):
        queue.check_invariants()
        live = {id(n) for n in queue.live_nodes()}
        for node in seen.values():
            assert (id(node) in live) == tree.evictable(node, t), \
                f"{node} evictable from tier {t} but queue membership disagrees"
    return seen


def check_cache(cache, extra_locks=()) -> None:
    """``extra_locks``: nodes locked by holders other than live sequences (recovered ones)."""
    tree = cache.tree
    bb, bs = cache.block_bytes, cache.block_size
    nodes = check_tree(tree)
    cache.device.check_invariants()

    owners: Counter = Counter()
    for node in nodes.values():
        if node.slots[DEVICE] is not None:
            owners.update(node.slots[DEVICE])
    assert all(c == 1 for c in owners.values()), "a device slot is in the index twice"

    locks: Counter = Counter(id(n) for n in extra_locks)
    shared_tail = cache.shared_tails()
    tails: Counter = Counter()
    private: Counter = Counter()
    for seq in cache.sequences():
        seq_id = seq.id
        assert cache.sequence(seq_id) is seq
        n = seq.num_tokens
        assert len(seq.block_table) == -(-n // bs), f"seq {seq_id}: table length wrong"
        node = seq.node
        locks[id(node)] += 1
        path = path_to(node)
        assert (not path) or id(node) in nodes, f"seq {seq_id} locks a node not in the tree"
        path_slots = [s for p in path for s in p.slots[DEVICE]]
        assert seq.num_indexed == len(path_slots), f"seq {seq_id}: num_indexed != path length"
        assert seq.block_table[:seq.num_indexed] == path_slots, f"seq {seq_id}: table != index path"
        assert b"".join(p.tokens for p in path) == bytes(seq.tokens[:seq.num_indexed * bb]), \
            f"seq {seq_id}: indexed tokens differ from the sequence's"
        tail = seq.block_table[seq.num_indexed:]
        if tail and n % bs and tail[-1] in shared_tail:
            tails[tail[-1]] += 1
            tail = tail[:-1]
        private.update(tail)
        private.update(seq.dup_slots)
    for node in nodes.values():
        assert node.lock_ref == locks.get(id(node), 0), f"{node}: lock_ref != sequences locking it"
    assert dict(tails) == shared_tail, "shared tail counts drifted"
    for slot, count in tails.items():
        assert count >= 2 and slot not in private and slot not in owners
    assert all(c == 1 for c in private.values()), "a private slot is owned twice"
    assert not (set(private) & set(owners)), "a slot is both private and indexed"
    used = set(owners) | set(private) | set(tails)
    assert used == cache.device.used_slots(), "used device slots != index + sequences"
    for tier in (1, 2):
        alloc = cache.allocators[tier]
        held: Counter = Counter()
        for node in nodes.values():
            if node.slots[tier] is not None:
                held.update(node.slots[tier])
        if alloc is None:
            assert not held, f"blocks resident in absent tier {tier}"
            continue
        alloc.check_invariants()
        assert all(c == 1 for c in held.values()), f"a tier-{tier} slot is in the index twice"
        assert set(held) == alloc.used_slots(), f"tier-{tier} used slots != slots in the index"
    for node in nodes.values():
        if node.slots[2] is not None and cache.data is not None:
            assert node.checksums is not None, "a block on disk has no checksum"


def block_ref_counts(cache) -> dict[int, int]:
    """Device slot -> number of sequences whose block table holds it (the refcount)."""
    counts: Counter = Counter()
    for seq in cache.sequences():
        counts.update(set(seq.block_table) | set(seq.dup_slots))
    return dict(counts)
