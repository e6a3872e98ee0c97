"""A radix-tree node: a run of full blocks, their identity and where their bytes live."""

from __future__ import annotations

from prefixd.api.tiers import DEVICE, DISK, HOST, NUM_TIERS, TIER_NAMES  # noqa: F401 (re-exported)


class Node:
    """A run of consecutive full blocks sharing one residency, one refcount and one clock.

    Fields:
        parent, children: tree links; ``children`` maps a child's first block of packed tokens
            (``key``) to the child.
        tokens: packed int32 token ids of all ``num_blocks`` blocks (kept and compared on every
            hit, so a hash collision can never serve another prompt's KV).
        hashes: the chained 128-bit hash of each block (its durable name).
        slots: per tier (device, host, disk), the slot of each block, or ``None`` when the run is
            not resident in that tier. A run is resident in a tier wholly or not at all: a
            partial eviction or promotion splits the node first.
        checksums: per block, the checksum of its bytes once written down (else ``None``).
        disk_verified: the disk copy's bytes are known good in this process: it wrote them, or
            read them back against ``checksums`` (a promotion, an eager verify). A disk copy
            found by a recovery is unverified until then: a lookup does not promise it.
        kids_in: per tier, how many children are resident in that tier.
        lock_ref: sequences whose deepest indexed node is this one. A referenced block is on
            the path from the root to some locked node: the path above a locked node always has
            a device-resident child, so only unlocked leaves are evictable and pinning the
            deepest node protects the whole path.
        last_access, hit_count, priority: eviction keys (logical clock, hits, user priority).
        heap_tag: per tier, the tag of this node's live entry in that tier's eviction queue
            (0 when it is not evictable there).

    Invariants (checked by ``PrefixCache.check_invariants``): ``len(tokens) ==
    num_blocks * block_bytes``; ``key == tokens[:block_bytes]``; resident in tier T implies the
    parent is resident in T (or is a root): every tier holds root-anchored prefixes; every
    non-root node is resident in at least one tier; ``disk_verified`` implies resident on disk.
    """

    __slots__ = (
        "parent", "children", "key", "tokens", "num_blocks", "hashes", "slots", "checksums",
        "disk_verified", "kids_in", "lock_ref", "last_access", "hit_count", "priority", "heap_tag",
    )

    def __init__(self, parent, key, tokens, num_blocks, hashes, slots, last_access=0):
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.key = key
        self.tokens = tokens
        self.num_blocks = num_blocks
        self.hashes: list[bytes] = hashes
        self.slots: list[list[int] | None] = slots
        self.checksums: list[int] | None = None
        self.disk_verified = False
        self.kids_in = [0, 0, 0]
        self.lock_ref = 0
        self.last_access = last_access
        self.hit_count = 0
        self.priority = 0
        self.heap_tag = [0, 0, 0]

    @property
    def last_hash(self) -> bytes:
        return self.hashes[-1]

    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        where = "".join(n[0] for n, s in zip(("d", "h", "k"), self.slots) if s is not None)
        return f"Node(blocks={self.num_blocks}, in={where or '-'}, lock={self.lock_ref})"


def new_root(root_hash: bytes) -> Node:
    """A namespace root: no blocks, resident everywhere, never evicted."""
    root = Node(None, b"", b"", 0, [root_hash], [[], [], []])
    return root


def split(node: Node, k: int, block_bytes: int) -> Node:
    """Cut ``node`` after its first ``k`` blocks; return the new head (the upper part).

    ``node`` keeps its identity as the lower part (tail), so a sequence that locks it still
    references every block it did, and an eviction queue entry for it stays valid.
    """
    assert 0 < k < node.num_blocks, "split point must fall inside the node"
    cut = k * block_bytes
    parent = node.parent
    head = Node(
        parent, node.key, node.tokens[:cut], k, node.hashes[:k],
        [None if s is None else s[:k] for s in node.slots], node.last_access,
    )
    head.hit_count = node.hit_count
    head.disk_verified = node.disk_verified
    head.priority = node.priority
    if node.checksums is not None:
        head.checksums = node.checksums[:k]
        node.checksums = node.checksums[k:]
    head.kids_in = [0 if s is None else 1 for s in node.slots]
    parent.children[node.key] = head
    node.tokens = node.tokens[cut:]
    node.key = node.tokens[:block_bytes]
    node.hashes = node.hashes[k:]
    node.slots = [None if s is None else s[k:] for s in node.slots]
    node.num_blocks -= k
    node.parent = head
    head.children[node.key] = node
    return head


def attached(node: Node) -> bool:
    """Whether ``node`` is still in its tree (a forgotten run keeps its parent link)."""
    while node.parent is not None:
        if node.parent.children.get(node.key) is not node:
            return False
        node = node.parent
    return True


def path_to(node: Node) -> list[Node]:
    """Nodes from just below the root down to ``node`` (inclusive)."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path
