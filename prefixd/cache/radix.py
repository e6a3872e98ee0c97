"""The index: one radix tree of full blocks across the three tiers."""

from __future__ import annotations

from prefixd.cache.hashing import chain_hashes, namespace_hash
from prefixd.cache.node import DEVICE, NUM_TIERS, Node, new_root, split
from prefixd.cache.policy import EvictionQueue


def _common_blocks(run: bytes, tokens: bytes, pos: int, max_k: int, block_bytes: int) -> int:
    """How many leading blocks of ``run`` equal ``tokens[pos:]`` (at least 1: the key matched)."""
    lo, hi = 1, max_k
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if tokens.startswith(run[: mid * block_bytes], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """Block-granular radix tree with per-tier residency and per-tier eviction queues.

    One root per namespace (``extra``: LoRA id, image hashes; the tenant salt is already in
    ``root_hash``), so sequences in different namespaces never share a block. A match that ends
    inside a node splits it, so a match always ends on a node boundary and a sequence locks
    whole nodes.

    A node is evictable from tier T when it is resident in T, no child is resident in T, and no
    sequence locks it. The queue of tier T holds exactly those nodes. (A sequence locks only its
    deepest node; the path above it has a device-resident child, so it is safe on the device.)

    Invariants: see ``Node``; also ``num_blocks_in[T]`` is the number of blocks resident in T,
    and ``locked`` holds exactly the non-root nodes with ``lock_ref > 0`` (what
    ``pinned_device_blocks`` walks up from; a run forgotten while locked, resident nowhere,
    stays in it until unlocked).

    While a checkpoint pictures the tree in slices (``prefixd.engine.picture_walk``),
    ``changed`` collects every node whose checkpointed fields change (``mark``): a touch, a
    split (both parts), a residency placed or dropped (a node added or forgotten included; a
    run's checksums change only with a placement).
    """

    def __init__(self, block_size: int, root_hash: bytes, policy, tiers=(DEVICE,)) -> None:
        self.block_size = block_size
        self.tiers = tuple(tiers)  # the tiers present, device first
        self.block_bytes = block_size * 4
        self.root_hash = root_hash
        self.roots: dict[bytes, Node] = {}
        self.queues = [EvictionQueue(t, policy) for t in range(NUM_TIERS)]
        self.num_blocks_in = [0] * NUM_TIERS
        self.clock = 0
        self.locked: set[Node] = set()  # every non-root node with ``lock_ref > 0``
        self.changed: set[Node] | None = None  # while a checkpoint's picture is taken: ``mark``

    def root(self, extra: bytes) -> Node:
        root = self.roots.get(extra)
        if root is None:
            root = self.roots[extra] = new_root(namespace_hash(self.root_hash, extra))
        return root

    # -- matching ------------------------------------------------------------------------

    def peek(self, root: Node, tokens: bytes, max_blocks: int) -> list[tuple[Node, int]]:
        """Longest cached run of whole blocks (at most ``max_blocks``), as ``(node, blocks
        matched in it)`` pairs; changes nothing (``take`` applies it). Only the last pair may
        match part of its node."""
        bb = self.block_bytes
        limit = max_blocks * bb
        out = []
        children = root.children
        pos = 0
        while pos < limit and children:
            child = children.get(tokens[pos:pos + bb])
            if child is None:
                break
            run = child.tokens
            end = pos + len(run)
            if end <= limit and tokens.startswith(run, pos):
                out.append((child, child.num_blocks))
                pos = end
                children = child.children
            else:  # the match ends inside ``child``
                out.append((child, _common_blocks(run, tokens, pos, min(child.num_blocks, (limit - pos) // bb), bb)))
                break
        return out

    def take(self, pairs: list[tuple[Node, int]]) -> list[Node]:
        """Apply ``peek``'s match (nothing may have changed the tree since): split the last node
        where the match ends inside it, so that the match ends on a node boundary, and touch
        every matched node. Returns the matched nodes, root side first.

        NOTE: ``open`` peeks, checks that the request fits, and only then takes: a refused
        request neither splits nor touches its match.
        """
        self.clock += 1
        clock = self.clock
        path = []
        for node, k in pairs:
            if k < node.num_blocks:
                node = self.split(node, k)
            node.last_access = clock
            node.hit_count += 1
            path.append(node)
        if self.changed is not None:
            self.changed.update(path)
        return path

    # -- insertion -----------------------------------------------------------------------

    def insert(self, node: Node, tokens: bytes, slots: list[int],
               adopted: list[Node]) -> tuple[Node, list[int], Node | None]:
        """Index full blocks ``tokens`` (device-resident at ``slots``) below ``node``.

        Blocks already in the tree are not stored twice: where the tree has them on device the
        caller must switch to the tree's slots; where it has them only in lower tiers, the
        caller's device slots become their device copy, and the run is appended to
        ``adopted`` (its residency changed: the caller logs it). The deepest node comes back
        locked once for the caller (who moves its lock there from ``node``).

        Returns:
            ``(deepest, tree_slots, new)``: the node holding the last block, the device slot of
            each given block in the tree afterwards (``slots`` itself when nothing was already
            there), and the node created (``None`` when every block was already indexed).
        """
        bb = self.block_bytes
        self.clock += 1
        clock = self.clock
        pos, n = 0, len(tokens)
        tree_slots = None
        while pos < n:
            child = node.children.get(tokens[pos:pos + bb])
            if child is None:
                break
            k = _common_blocks(child.tokens, tokens, pos, min(child.num_blocks, (n - pos) // bb), bb)
            if k < child.num_blocks:
                child = self.split(child, k)
            first = pos // bb
            if child.slots[DEVICE] is None:
                self.set_residency(child, DEVICE, slots[first:first + k])
                adopted.append(child)
            if tree_slots is None:
                tree_slots = slots[:first]
            tree_slots += child.slots[DEVICE]
            child.last_access = clock
            if self.changed is not None:
                self.changed.add(child)
            node = child
            pos += k * bb
        if pos == n:
            self.lock(node)
            return node, tree_slots, None
        first = pos // bb
        rest = tokens[pos:] if pos else tokens
        mine = slots[first:] if first else slots
        new = Node(node, rest[:bb], rest, (n - pos) // bb,
                   chain_hashes(node.hashes[-1], rest, bb), [None, None, None], clock)
        new.lock_ref = 1  # locked for the caller before it can enter an eviction queue
        self.locked.add(new)
        node.children[new.key] = new
        self.place(new, DEVICE, mine)  # ``set_residency`` less the queue check: ``new`` is locked
        if node.heap_tag[DEVICE]:
            self.queues[DEVICE].discard(node)
        if tree_slots is not None:
            tree_slots += mine
        else:
            tree_slots = slots
        return new, tree_slots, new

    def split(self, node: Node, k: int) -> Node:
        """``node.split`` of ``node`` after ``k`` blocks (returns the head), both parts marked."""
        head = split(node, k, self.block_bytes)
        if self.changed is not None:
            self.changed.update((head, node))
        return head

    def mark(self, node: Node) -> None:
        """``node``'s checkpointed fields changed (see ``changed``)."""
        if self.changed is not None:
            self.changed.add(node)

    # -- residency and eviction ----------------------------------------------------------

    def evictable(self, node: Node, tier: int) -> bool:
        """Whether ``node`` belongs in ``tier``'s eviction queue (resident there, no child
        resident there, unlocked, not a root)."""
        return (node.parent is not None and node.slots[tier] is not None
                and not node.kids_in[tier] and not node.lock_ref)

    def place(self, node: Node, tier: int, slots: list[int]) -> None:
        """Record ``node``'s copy in ``tier`` at ``slots``: its slots, the tier's block count
        and the parent's ``kids_in``, but not the eviction queues.

        NOTE: this and ``unplace`` are the one copy of residency bookkeeping. Live operations
        use ``set_residency`` / ``drop_residency`` (these plus the queues); replay,
        reconciliation and checkpoint load use them bare, once per record or run, and rebuild
        the queues once at the end (``rebuild_queues``).
        """
        node.slots[tier] = slots
        self.num_blocks_in[tier] += node.num_blocks
        node.parent.kids_in[tier] += 1
        if self.changed is not None:
            self.changed.add(node)

    def unplace(self, node: Node, tier: int) -> tuple[list[int], bool]:
        """Forget ``node``'s copy in ``tier`` (not the queues); returns ``(its slots,
        forgotten)``. A node resident nowhere leaves the tree (it can have no children then:
        each child would be resident in some tier, and so would this node).

        Raises:
            ValueError: the node would be resident nowhere but keeps children (a log that
                does not fit the tree; live operations never get here).
        """
        s = node.slots
        slots = s[tier]
        s[tier] = None
        if self.changed is not None:
            self.changed.add(node)
        self.num_blocks_in[tier] -= node.num_blocks
        parent = node.parent
        parent.kids_in[tier] -= 1
        if s[0] is None and s[1] is None and s[2] is None:
            if node.children:
                raise ValueError(f"{node} is resident nowhere but keeps {len(node.children)} children")
            del parent.children[node.key]
            return slots, True
        return slots, False

    def set_residency(self, node: Node, tier: int, slots: list[int]) -> None:
        """Record that ``node``'s blocks now live in ``tier`` at ``slots`` (queues kept)."""
        assert node.slots[tier] is None and len(slots) == node.num_blocks
        self.place(node, tier, slots)
        self.queues[tier].discard(node.parent)
        if self.evictable(node, tier):
            self.queues[tier].add(node)

    def drop_residency(self, node: Node, tier: int) -> tuple[list[int], bool]:
        """Forget ``node``'s copy in ``tier`` (queues kept); returns ``(freed slots,
        forgotten)`` as ``unplace`` does."""
        slots, forgotten = self.unplace(node, tier)
        tags = node.heap_tag
        if tags[tier]:
            self.queues[tier].discard(node)
        parent = node.parent
        if not parent.kids_in[tier] and self.evictable(parent, tier):
            self.queues[tier].add(parent)
        if forgotten and (tags[0] or tags[1] or tags[2]):
            for queue in self.queues:
                queue.discard(node)
        return slots, forgotten

    def pop_victim(self, tier: int) -> Node | None:
        """The next node to evict from ``tier`` (removed from its queue), or ``None``.

        NOTE: whole nodes are evicted, never a part: every block of a node shares one access
        time and one hit count, so the blocks freed beyond the need are the very next victims
        anyway, and not splitting saves a node per eviction on the hot path.
        """
        return self.queues[tier].pop()

    def lock(self, node: Node) -> None:
        """One more reference: the node leaves every eviction queue."""
        if not node.lock_ref:
            tags = node.heap_tag
            if tags[0] or tags[1] or tags[2]:
                for queue in self.queues:
                    queue.discard(node)
            if node.parent is not None:
                self.locked.add(node)
        node.lock_ref += 1

    def unlock(self, node: Node) -> None:
        node.lock_ref -= 1
        if not node.lock_ref and node.parent is not None:
            self.locked.discard(node)
            slots, kids = node.slots, node.kids_in
            for tier in self.tiers:
                if slots[tier] is not None and not kids[tier]:
                    self.queues[tier].add(node)

    def pinned_device_blocks(self, path=()) -> int:
        """Device blocks that no eviction can free: every device-resident locked node and the
        path above it (each node's device subtree holds a lock). ``path``: ``(node, blocks)``
        pairs of a match about to be locked (``peek``'s), counted as pinned too.

        Costs one step per pinned node (the walk up stops at the first node already seen);
        ``PrefixCache.can_allocate`` calls it only when a request must evict.
        """
        if not self.locked and not path:
            return 0
        seen: set[int] = set()
        pinned = 0
        for node in self.locked:
            if node.slots[DEVICE] is None:
                continue  # a lock off the device (a recovered sequence) pins nothing there
            while node.parent is not None and id(node) not in seen:
                seen.add(id(node))
                pinned += node.num_blocks
                node = node.parent
        for node, k in path:
            if node.slots[DEVICE] is None:
                break  # device residency is root-anchored: the rest of the path is not there
            if id(node) not in seen:
                pinned += k  # a match ending inside ``node`` splits it and locks the head only
        return pinned

    def rebuild_queues(self, order=None) -> None:
        """Fresh eviction queues holding exactly the evictable nodes (after recovery).

        ``order``: every node of the tree, parents before children as ``nodes()`` yields them
        (nodes no longer in the tree may be left in: they are resident nowhere), when the
        caller already walked the tree; one pass resets the tags and fills the queues.
        """
        policy = self.queues[0].policy
        self.queues = queues = [EvictionQueue(t, policy) for t in range(NUM_TIERS)]
        tiers = [(t, queues[t].add) for t in self.tiers]
        for node in self.nodes() if order is None else order:
            node.heap_tag = [0, 0, 0]
            if node.lock_ref:
                continue
            slots, kids = node.slots, node.kids_in
            for tier, add in tiers:
                if slots[tier] is not None and not kids[tier]:
                    add(node)

    def check_invariants(self) -> None:
        """Links, keys, chained hashes, residency counts and queue membership (tests only)."""
        from prefixd.cache.invariants import check_tree

        check_tree(self)

    def nodes(self):
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)
