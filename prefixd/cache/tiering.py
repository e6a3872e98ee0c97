"""Residency across tiers: demotion on eviction, write policies, promotion on a hit.

The radix tree records where each run of blocks lives; this module decides when runs move and
asks the storage layer (``TierStore``-like: ``copy(src_tier, src_slots, dst_tier, dst_slots,
verify=...)`` returning checksums and per-block verdicts) to move their bytes. Without a store
(index-only benchmarks) only the bookkeeping happens.

Rules (DESIGN.md "The index: one radix tree across tiers"):

* Eviction from tier T takes the queue's next node (unlocked, no child resident in T). If the
  node is resident in no lower tier and the write policy keeps it, it is first copied to the
  nearest lower tier present (with any ancestors missing there, so that tier stays
  root-anchored); evicting from the bottom tier forgets.
* ``write_through`` (default): a committed run is copied to every lower tier at commit.
  ``write_back``: copied down only when evicted. ``selective``: like write_back, but only runs
  hit at least ``selective_hits`` times are kept; the rest are forgotten.
* A hit on host or disk promotes the matched run into device slots before ``open`` returns. A
  block read from disk whose checksum fails is dropped from the index with every block below
  it on disk; the match is cut there and never serves it.

NOTE: a lock (a sequence referencing a node) keeps the node in every tier it is in, not just on
the device: the demotion and promotion paths lock the runs they move, and that is how they keep
a cascade of evictions in a lower tier from taking the run being moved.
"""

from __future__ import annotations

import logging

from prefixd.cache.events import BlocksDropped, BlocksMoved, new_event
from prefixd.cache.node import DEVICE, DISK, HOST, TIER_NAMES, Node, attached, path_to
from prefixd.crashpoints import crash_point

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "selective")


class Tiering:
    """Moves runs between the tiers of one cache.

    Args:
        cache: the owning ``PrefixCache`` (its tree, allocators, events and stats).
        store: byte mover, or ``None`` for bookkeeping only.
        write_policy: one of ``WRITE_POLICIES``.
        selective_hits: the hit count from which ``selective`` keeps a run.
    """

    def __init__(self, cache, store, write_policy: str = "write_through", selective_hits: int = 2) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if selective_hits < 1:
            raise ValueError(f"selective_hits must be >= 1, got {selective_hits}")
        self.cache = cache
        self.tree = cache.tree
        self.allocs = cache.allocators
        self.store = store
        self._copy_run = getattr(store, "copy_run", None)  # a ``TierStore``'s run-to-run fast path
        self.write_policy = write_policy
        self.selective_hits = selective_hits
        self.lower = [t for t in (HOST, DISK) if self.allocs[t] is not None]
        self.defer_frees = False  # set by the durable engine: lower-tier slots wait for the WAL
        self.defer_disk = False   # set by the durable engine: write-through to disk is batched
        self.pending_disk: list[Node] = []
        self.pending_disk_blocks = 0

    def set_write_policy(self, write_policy: str) -> None:
        """Use ``write_policy`` for runs indexed or evicted from now on (a live config change;
        runs already placed stay where they are)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.write_policy = write_policy

    # -- eviction ------------------------------------------------------------------------

    def evict(self, tier: int, num_blocks: int) -> int:
        """Free at least ``num_blocks`` slots of ``tier`` if the queue allows; returns freed."""
        tree, freed = self.tree, 0
        while freed < num_blocks:
            node = tree.pop_victim(tier)
            if node is None:
                break
            freed += self._evict_victim(node, tier)
        self.cache.stats.evicted_by_tier[tier] += freed
        return freed

    def _evict_victim(self, node: Node, tier: int) -> int:
        """Evict ``node`` (out of the queue already) from ``tier``; returns the slots freed."""
        tree, stats = self.tree, self.cache.stats
        if self._keeps(node, tier):
            tree.lock(node)  # the cascade below must not take the victim
            try:
                if self.write_down(node, self._next_lower(tier)):
                    stats.demoted_by_tier[tier] += node.num_blocks
                freed = self.drop(node, tier)
            finally:
                tree.unlock(node)  # re-queues it in the tier it went down to
        else:
            freed = self.drop(node, tier)
        crash_point("evict_inside")
        return freed

    def drop(self, node: Node, tier: int) -> int:
        """Forget ``node``'s copy in ``tier`` and free its slots; returns how many."""
        slots, forgotten = self.tree.drop_residency(node, tier)
        alloc = self.allocs[tier]
        if tier != DEVICE and self.defer_frees:
            alloc.defer_free(slots)
        else:
            alloc.free(slots)
        self.cache.events.append(new_event(BlocksDropped, (tier, node.hashes, slots, forgotten)))
        if tier == DISK:
            node.disk_verified = False
        if forgotten:
            node.checksums = None
        return len(slots)

    def _keeps(self, node: Node, tier: int) -> bool:
        """Whether evicting ``node`` from ``tier`` copies it down first."""
        if tier == DISK or self._next_lower(tier) is None:
            return False
        if any(node.slots[t] is not None for t in range(tier + 1, 3)):
            return False
        if self.write_policy == "selective":
            return node.hit_count >= self.selective_hits
        return True

    def _next_lower(self, tier: int) -> int | None:
        for t in self.lower:
            if t > tier:
                return t
        return None

    # -- moving bytes down ---------------------------------------------------------------

    def write_path_down(self, node: Node, tier: int) -> bool:
        """Give every run on the path to ``node`` a copy that survives in ``tier`` (a disk copy
        counts for HOST too: it survives more), copying what is missing (``write_down``);
        False when the tier has no room (the runs copied so far keep their copies)."""
        for n in path_to(node):
            if n.slots[DISK] is not None or (tier == HOST and n.slots[HOST] is not None):
                continue
            if not self.write_down(n, tier):
                return False
        return True

    def write_down(self, node: Node, tier: int | None) -> bool:
        """Copy ``node`` (and its ancestors missing there) into ``tier``; best effort.

        Returns whether ``node`` is resident in ``tier`` afterwards.
        """
        if tier is None:
            return False
        chain = []
        up = node
        while up.parent is not None and up.slots[tier] is None:
            chain.append(up)
            up = up.parent
        if not chain:
            return True
        chain.reverse()
        anchor = up  # already in ``tier`` (or a root): must stay there during the cascade
        for n in (anchor, *chain):
            self.tree.lock(n)
        try:
            need = sum(n.num_blocks for n in chain)
            slots = self.cache.allocation.allocate(tier, need)
            if slots is None:
                log.debug("write-down skipped tier=%s blocks=%d: no room", TIER_NAMES[tier], need)
                return False
            self._copy_into(chain, tier, slots)
            return True
        finally:
            for n in (anchor, *chain):
                self.tree.unlock(n)

    def _copy_into(self, chain: list[Node], tier: int, slots: list[int]) -> None:
        """Copy each run of ``chain`` from its highest tier into ``tier`` at ``slots``."""
        checksums = None
        store = self.store
        if len(chain) == 1 and tier != DISK and self._copy_run is not None and self._copy_one(chain[0], tier, slots):
            return
        if store is not None:
            checksums = []
            by_src: dict[int, tuple[list[int], list[int]]] = {}
            pos = 0
            for n in chain:
                src = next(t for t in range(3) if n.slots[t] is not None)
                s, d = by_src.setdefault(src, ([], []))
                s += n.slots[src]
                d += slots[pos:pos + n.num_blocks]
                pos += n.num_blocks
            # NOTE: a run's checksums are taken when it first goes to DISK, the one tier whose
            # blocks are checked (at recovery, or on first load); hashing host copies as well
            # would hash every block twice for numbers nothing reads.
            results = {}
            for src, (s, d) in by_src.items():
                verify = self._checksums_of(chain, src) if src == DISK else None
                results[src] = store.copy(src, s, tier, d, verify=verify, checksums=tier == DISK)
            # checksums per run, in chain order (bytes are the same in every tier)
            cursor = {src: 0 for src in by_src}
            for n in chain:
                src = next(t for t in range(3) if n.slots[t] is not None)
                i = cursor[src]
                cursor[src] = i + n.num_blocks
                sums = results[src].checksums
                checksums.append(sums[i:i + n.num_blocks] if sums is not None else None)
        pos = 0
        for k, n in enumerate(chain):
            mine = slots[pos:pos + n.num_blocks]
            pos += n.num_blocks
            sums = checksums[k] if checksums is not None else None
            if sums is not None and sums != n.checksums:
                n.checksums = sums  # marked for a picture by the placement below
            else:
                sums = []  # already known: the move record need not repeat them
            self.tree.set_residency(n, tier, mine)
            if tier == DISK:
                n.disk_verified = True  # its bytes come from this process's memory tiers
            self.cache.events.append(new_event(BlocksMoved, (tier, n.hashes, mine, sums)))

    def _copy_one(self, node: Node, tier: int, slots: list[int]) -> bool:
        """``_copy_into`` of one device-resident run into a memory tier when both its slots and
        ``slots`` are single runs (a commit's write-through mostly is): the store's
        ``copy_run``, and no checksums (only DISK copies carry them). False, with nothing done,
        otherwise."""
        src = node.slots[DEVICE]
        if src is None or not self._copy_run(DEVICE, src, tier, slots):
            return False
        self.tree.set_residency(node, tier, slots)
        self.cache.events.append(new_event(BlocksMoved, (tier, node.hashes, slots, [])))
        return True

    @staticmethod
    def _checksums_of(chain: list[Node], src: int) -> list[int]:
        out = []
        for n in chain:
            if n.slots[src] is not None:
                out += n.checksums
        return out

    def write_through(self, node: Node) -> None:
        """A newly indexed run goes down to every lower tier (``write_through`` policy)."""
        if self.write_policy != "write_through":
            return
        for tier in self.lower:
            if tier == DISK and self.defer_disk:
                self.pending_disk.append(node)
                self.pending_disk_blocks += node.num_blocks
            else:
                self.write_down(node, tier)

    def spill(self) -> int:
        """Write the runs waiting for disk (``defer_disk``), each with its ancestors missing
        there; returns how many of the waiting runs went down.

        All of them as one batch when the disk tier has room for all (one allocation, one copy
        per source tier: one snapshot and one writer job), else one run at a time, as many as
        fit (``write_down``'s best effort).

        NOTE: one batch, not one ``write_down`` per run: each store copy carries its gather,
        hashing call, writer job and range checks, and a spill of many short runs would pay
        them once a run."""
        pending, self.pending_disk = self.pending_disk, []
        self.pending_disk_blocks = 0
        chains: list[list[Node]] = []
        anchors: list[Node] = []
        taken: set[int] = set()
        for node in pending:
            if node.slots[DISK] is not None or not attached(node):
                continue
            chain = []
            up = node
            while up.parent is not None and up.slots[DISK] is None and id(up) not in taken:
                chain.append(up)
                up = up.parent
            if chain:  # else an earlier run's chain holds it
                chain.reverse()
                taken.update(map(id, chain))
                chains.append(chain)
                anchors.append(up)  # on disk, the root, or in an earlier chain of this batch
        if not chains:
            return 0
        runs = [n for chain in chains for n in chain]
        held = anchors + runs
        tree = self.tree
        for n in held:
            tree.lock(n)
        try:
            slots = self.cache.allocation.allocate(DISK, sum(n.num_blocks for n in runs))
            if slots is not None:
                self._copy_into(runs, DISK, slots)  # parents first: chains in order
                return len(chains)
        finally:
            for n in held:
                tree.unlock(n)
        log.debug("spill of %d runs one at a time: no room for all at once", len(chains))
        return sum(1 for chain in chains if chain[-1].slots[DISK] is None and attached(chain[-1])
                   and self.write_down(chain[-1], DISK))

    # -- promotion -----------------------------------------------------------------------

    def promote(self, path: list[Node]) -> list[Node]:
        """Bring the matched ``path`` onto the device; returns the part that was promoted.

        The path is cut at the first run that cannot be had (no device room, or a checksum
        failure on disk); what is returned is entirely device-resident.
        """
        first = next(i for i, n in enumerate(path) if n.slots[DEVICE] is None)
        for n in path:
            self.tree.lock(n)
        try:
            need = sum(n.num_blocks for n in path[first:])
            slots = self.cache.allocation.allocate(DEVICE, need)
            if slots is None:
                return path[:first]
            return path[:first] + self._promote_runs(path[first:], slots)
        finally:
            for n in path:
                self.tree.unlock(n)

    def _promote_runs(self, runs: list[Node], slots: list[int]) -> list[Node]:
        stats = self.cache.stats
        bs = self.cache.block_size
        store = self.store
        done: list[Node] = []
        pos = 0
        for n in runs:
            src = HOST if n.slots[HOST] is not None else DISK
            dst = slots[pos:pos + n.num_blocks]
            good = n.num_blocks
            if store is not None:
                verify = n.checksums if src == DISK else None
                result = store.copy(src, n.slots[src], DEVICE, dst, verify=verify)
                bad = result.bad_positions
                if bad:
                    good = bad[0]
                    log.warning("disk checksum mismatch: %d block(s) bad, first slot=%d",
                                len(bad), n.slots[src][good])
            if good < n.num_blocks:
                head = self.cut_corrupt(n, good)
                if head is not None:
                    head.disk_verified = True  # its blocks passed, up to the bad one
                    self.tree.set_residency(head, DEVICE, dst[:good])
                    self._moved(head, DEVICE)
                    stats.hit_tokens_by_tier[src] += good * bs
                    stats.promoted_by_tier[src] += good
                    done.append(head)
                    pos += good
                break
            crash_point("promote_inside")
            if src == DISK:
                n.disk_verified = True
            self.tree.set_residency(n, DEVICE, dst)
            self._moved(n, DEVICE)
            stats.hit_tokens_by_tier[src] += n.num_blocks * bs
            stats.promoted_by_tier[src] += n.num_blocks
            done.append(n)
            pos += n.num_blocks
        if pos < len(slots):
            self.allocs[DEVICE].free(slots[pos:])
        return done

    def _moved(self, node: Node, tier: int) -> None:
        # a promotion copies known bytes: their checksums came with an earlier move
        self.cache.events.append(new_event(BlocksMoved, (tier, node.hashes, node.slots[tier], [])))

    def cut_corrupt(self, node: Node, good: int) -> Node | None:
        """Block ``good`` of ``node`` failed its disk checksum: forget it and everything below it
        on disk. Returns the run of the ``good`` blocks before it (``None`` when ``good == 0``)."""
        head = self.tree.split(node, good) if good else None  # node keeps the tail
        self.cache.stats.corrupt_blocks += 1
        self._drop_disk_subtree(node)
        return head

    def _drop_disk_subtree(self, node: Node) -> None:
        """A corrupt disk run: forget it and everything below it on disk (post-order)."""
        order = []
        stack = [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(c for c in n.children.values() if c.slots[DISK] is not None)
        for n in reversed(order):
            self.drop(n, DISK)
