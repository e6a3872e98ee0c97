"""The cache core: sequences over a shared radix tree of device blocks."""

from __future__ import annotations

from collections.abc import Iterable

from prefixd.api.layout import as_token_bytes
from prefixd.cache import events as ev
from prefixd.cache.events import SeqExtended, SeqOpened, SeqReleased, new_event
from prefixd.cache.indexer import Indexer
from prefixd.cache.errors import InvalidTokens, OutOfBlocks, UnknownSequence
from prefixd.cache.lookup import LookupResult, lookup
from prefixd.cache.node import DEVICE, Node, path_to
from prefixd.cache.policy import make_policy
from prefixd.cache.radix import RadixTree
from prefixd.cache.sequence import Sequence
from prefixd.cache.shared_tails import SharedTails
from prefixd.cache.stats import CacheStats  # noqa: F401 (re-exported)
from prefixd.cache.allocation import Allocation
from prefixd.storage.slots import SlotAllocator


class PrefixCache:
    """Prefix sharing over one pool: open / extend / commit / fork / release.

    Device slots are owned by exactly one of: the free list, the index (a node's device run), a
    sequence (its private tail and its dup slots). A partial last block may be shared by forked
    siblings; ``_shared_tail`` (``SharedTails``) counts its references (only while more than one).

    Every change appends a typed event (``prefixd.cache.events``) for the WAL; callers drain
    them with ``drain_events``. Hashes are computed only for blocks newly indexed at commit; a
    hit compares token bytes, never hashes.

    Args:
        num_blocks: device pool size in blocks, or ``(device, host, disk)`` sizes; a lower tier
            of size 0 is absent.
        block_size: tokens per block.
        root_hash: the namespace root (``hashing.root_hash`` of the persisted seed, the tenant
            salt and the layout digest).
        policy: eviction order, ``"lru"``, ``"lfu"`` or ``"priority"``.
        data: the byte mover (a ``prefixd.storage.TierStore``): ``copy_within`` for
            copy-on-write, ``copy`` between tiers; ``None`` when there are no bytes (index-only
            benchmarks). When it has ``allocator(tier)``, its allocators are used.
        write_policy, selective_hits: see ``prefixd.cache.tiering``.
    """

    def __init__(self, num_blocks, block_size: int = 16, *, root_hash: bytes = b"\x00" * 16,
                 policy: str = "lru", data=None, write_policy: str = "write_through",
                 selective_hits: int = 2) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        sizes = [num_blocks, 0, 0] if isinstance(num_blocks, int) else list(num_blocks) + [0] * (3 - len(num_blocks))
        if len(sizes) != 3 or any(not isinstance(n, int) or n < 0 for n in sizes) or sizes[0] < 1:
            raise ValueError(f"num_blocks must be a positive int or (device, host, disk) sizes, got {num_blocks!r}")
        self.block_size = block_size
        self.block_bytes = block_size * 4
        if data is not None and hasattr(data, "allocator"):
            self.allocators = [data.allocator(t) if n else None for t, n in enumerate(sizes)]
            assert all(a is None or a.num_slots == n for a, n in zip(self.allocators, sizes)), \
                "num_blocks differs from the store's pool sizes"
        else:
            self.allocators = [SlotAllocator(n) if n else None for n in sizes]
        self.device = self.allocators[DEVICE]
        tiers = [t for t, a in enumerate(self.allocators) if a is not None]
        self.tree = RadixTree(block_size, root_hash, make_policy(policy), tiers)
        self.data = data
        self.on_tier_full = None  # (tier, n): the engine makes room across a tier's pools
        self.on_deferred_shortage = None  # the durable engine commits the WAL and releases
        self.tiering = None
        if len(tiers) > 1 or write_policy != "write_through":
            from prefixd.cache.tiering import Tiering

            self.tiering = Tiering(self, data, write_policy, selective_hits)
        self.stats = CacheStats()
        self.events: list = []
        self.allocation = Allocation(self)
        self.indexer = Indexer(self.tree, self.block_bytes, self.events, self.stats, self.tiering)
        self._seqs: dict[int, Sequence] = {}
        self._shared_tail = SharedTails()
        self._next_id = 1

    # -- queries -------------------------------------------------------------------------

    def sequence(self, seq_id: int) -> Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def private_blocks(self, seq_id: int) -> range:
        """The logical blocks whose KV only this sequence holds, which its client may write:
        those past its indexed prefix, less a partial last block still shared with forked
        siblings (an ``extend`` copies it first). Indexed blocks are immutable."""
        seq = self.sequence(seq_id)
        table = seq.block_table
        end = len(table)
        if end > seq.num_indexed and self._shared_tail and table[-1] in self._shared_tail:
            end -= 1
        return range(seq.num_indexed, end)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def sequences(self) -> Iterable[Sequence]:
        """The live sequences, oldest first (a view: do not open or release while iterating)."""
        return self._seqs.values()

    def shared_tails(self) -> dict[int, int]:
        """Device slot -> how many forked siblings share it as their partial last block (only
        slots shared by more than one); a copy."""
        return dict(self._shared_tail)

    @property
    def next_seq_id(self) -> int:
        """The id the next open or fork gives (checkpoints save it)."""
        return self._next_id

    def restore_next_seq_id(self, next_id: int) -> None:
        """Recovery only: continue numbering after every id the log or checkpoint named, so
        that no id is given twice across restarts.

        Raises:
            ValueError: ``next_id`` would go back (a live sequence may hold a later id).
        """
        if next_id < self._next_id:
            raise ValueError(f"next sequence id {next_id} is below {self._next_id}: ids would repeat")
        self._next_id = next_id

    def lookup(self, tokens, extra: bytes = b"") -> LookupResult:
        """Cached tokens for ``tokens``, without pinning or touching anything (see
        ``prefixd.cache.lookup``: unverified disk tokens are not promised)."""
        return lookup(self.tree, self._tokens(tokens), extra)

    def drain_events(self) -> list:
        """The events since the last drain, in order; ``self.events`` stays the same list.

        NOTE: emptied in place, not replaced: an allocation short of quarantined slots drains
        in the middle of an operation (``on_deferred_shortage``), and a caller holding the list
        (``Indexer.index`` across its write-through) appended to a list already logged: the
        ``SeqCommitted`` record was lost and its commit acknowledged anyway
        (``tests/engine/test_commit_forces_reclaim.py``).
        """
        events = self.events
        out = events.copy()
        events.clear()
        return out

    # -- mutations -----------------------------------------------------------------------

    def open(self, tokens, extra: bytes = b"", *, full_match: bool = False,
             seq_id: int | None = None) -> Sequence:
        """Share the longest cached run of ``tokens`` and allocate blocks for the rest.

        At most ``len(tokens) - 1`` tokens are served from the cache (the engine must compute
        the last one to get its logits), unless ``full_match`` (a reclaim after a restart).
        ``seq_id``: the id to use (``reopen_recovered``: an id handed out before a restart and
        not live now); default: the next one.

        Raises:
            InvalidTokens: empty or malformed tokens.
            OutOfBlocks: not enough device blocks can be freed; nothing changed.
            ValueError: ``seq_id`` is live or was never handed out; nothing changed.
        """
        if seq_id is not None and (seq_id in self._seqs or not 0 < seq_id < self._next_id):
            raise ValueError(f"sequence id {seq_id} is live or was never handed out")
        if type(tokens) is not bytes or len(tokens) & 3:
            tokens = self._tokens(tokens)
        bs = self.block_size
        num_tokens = len(tokens) >> 2
        if not num_tokens:
            raise InvalidTokens("cannot open an empty sequence")
        tree = self.tree
        root = tree.roots.get(extra)
        total = -(-num_tokens // bs)
        pairs = tree.peek(root, tokens, (num_tokens - (not full_match)) // bs) if root is not None else []
        on_device = 0  # the match's leading blocks already on the device (root-anchored)
        promote = False
        for node, k in pairs:
            if node.slots[DEVICE] is None:
                promote = True
                break
            on_device += k
        # the new blocks from free slots when they suffice (nothing is evicted then)
        slots = None if promote else self.device.allocate(total - on_device)
        if slots is None:
            # it must evict, or promote into slots it may have to evict for: refuse before
            # any change if even that cannot make room, the match pinned too
            self.allocation.ensure_room(total - on_device, pairs)
        if root is None:
            root = tree.root(extra)
        path = tree.take(pairs) if pairs else pairs
        if promote:
            path = self.tiering.promote(path)
        if path:
            node = path[-1]
            if len(path) == 1:
                table = node.slots[DEVICE][:]
            else:
                table = []
                for n in path:
                    table += n.slots[DEVICE]
            if node.lock_ref:
                node.lock_ref += 1
            else:
                tree.lock(node)
            deepest_hash = node.hashes[-1]
        else:
            node = root
            node.lock_ref += 1
            table = []
            deepest_hash = b""
        num_cached = len(table)
        if slots is None:  # promoted (the match may have been cut), or short of free slots
            need = total - num_cached
            allocation = self.allocation
            slots = allocation.allocate(DEVICE, need) if promote else allocation.allocate_evicting(DEVICE, need)
            if slots is None:  # ``ensure_room`` said it could: a bug, but refuse cleanly
                tree.unlock(node)
                raise OutOfBlocks(need, self.device.num_free)
        table += slots
        if seq_id is None:
            seq_id = self._next_id
            self._next_id = seq_id + 1
        seq = Sequence(seq_id, extra, tokens, table, node, num_cached, num_cached * bs)
        self._seqs[seq_id] = seq
        stats = self.stats
        stats.opens += 1
        stats.requested_tokens += num_tokens
        stats.requested_blocks += num_tokens // bs
        stats.hit_tokens += num_cached * bs
        self.events.append(new_event(SeqOpened, (seq_id, num_tokens, num_cached, deepest_hash, extra)))
        return seq

    def extend(self, seq_id: int, tokens) -> list[int]:
        """Append token ids; returns the newly allocated slots (copy-on-write done first).

        Raises:
            UnknownSequence, InvalidTokens, OutOfBlocks (nothing changed).
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        add = tokens if type(tokens) is bytes and not len(tokens) & 3 else self._tokens(tokens)
        if not add:
            return []
        bs = self.block_size
        table = seq.block_table
        old = len(seq.tokens) >> 2
        need = -(-(old + (len(add) >> 2)) // bs) - len(table)
        cow = bool(old % bs and self._shared_tail and table[-1] in self._shared_tail)
        slots = []
        if need + cow:
            slots = self.device.allocate(need + cow)  # free slots: nothing to check or evict
            if slots is None:
                self.allocation.ensure_room(need + cow)
                slots = self.allocation.allocate_evicting(DEVICE, need + cow)
                if slots is None:  # ``ensure_room`` said it could: a bug, but refuse cleanly
                    raise OutOfBlocks(need + cow, self.device.num_free)
        if cow:
            new_slot = slots.pop()
            self._copy_on_write(seq, new_slot)
        table += slots
        toks = seq.tokens
        if type(toks) is bytes:  # its first extend: ``open`` kept the prompt's own bytes
            seq.tokens = toks = bytearray(toks)
        toks += add
        self.events.append(new_event(SeqExtended, (seq_id, len(seq.tokens) >> 2)))
        return slots

    def commit(self, seq_id: int) -> int:
        """Index the sequence's full blocks (the client has written their KV).

        Returns the number of blocks that entered the index. Where another sequence indexed the
        same blocks first, this sequence's table switches to the index's slots.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        return self.indexer.index(seq)

    def fork(self, seq_id: int, num_children: int) -> list[Sequence]:
        """``num_children`` new sequences sharing every block of ``seq_id``.

        NOTE: the parent's full blocks are indexed first (as by ``commit``): a fork follows a
        computed prefill or decode step, and indexing makes every shared full block immutable,
        so only the partial last block is ever shared privately and copied on write.
        """
        if num_children < 1:
            raise ValueError(f"num_children must be >= 1, got {num_children}")
        seq = self.sequence(seq_id)
        self.indexer.index(seq)
        children = []
        for _ in range(num_children):
            child_id = self._next_id
            self._next_id = child_id + 1
            child = Sequence(child_id, seq.extra, bytearray(seq.tokens), list(seq.block_table),
                             seq.node, seq.num_indexed, seq.cached_tokens)
            self.tree.lock(seq.node)
            self._seqs[child_id] = child
            children.append(child)
        if len(seq.block_table) > seq.num_indexed:
            self._shared_tail.share(seq.block_table[-1], num_children)
        self.events.append(ev.SeqForked(seq_id, tuple(c.id for c in children)))
        return children

    def release(self, seq_id: int, *, commit: bool = False) -> None:
        """Drop the sequence: indexed blocks stay cached, private ones are freed."""
        if commit:
            self.indexer.index(self.sequence(seq_id))
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(seq_id)
        node = seq.node
        if node.lock_ref > 1:
            node.lock_ref -= 1
        else:
            self.tree.unlock(node)
        owned = seq.block_table[seq.num_indexed:]
        shared = self._shared_tail
        if owned and shared and owned[-1] in shared:
            shared.drop(owned.pop())
        if seq.dup_slots:
            owned += seq.dup_slots
        self.device.free(owned)
        self.events.append(new_event(SeqReleased, (seq_id,)))

    def reopen_recovered(self, seq_id: int, node: Node, extra: bytes) -> Sequence:
        """Reopen a sequence that survived a restart only as a lock on ``node``, under its own
        id, then drop that lock. Its OPEN event supersedes the recovered sequence in the log
        (replay keys sequences by id): no ``SeqReleased``. Raises OutOfBlocks as ``open``
        (nothing changed, ``node`` stays locked)."""
        seq = self.open(b"".join(n.tokens for n in path_to(node)), extra, full_match=True, seq_id=seq_id)
        self.tree.unlock(node)
        return seq

    def release_recovered(self, seq_id: int, node: Node) -> None:
        """Release a sequence that survived a restart only as a lock on ``node`` (held by the
        engine until its client reclaims it or the grace period ends): unlock it and emit
        ``SeqReleased``, so that its release is logged like any other."""
        self.tree.unlock(node)
        self.events.append(new_event(SeqReleased, (seq_id,)))

    def evict(self, num_blocks: int, tier: int = DEVICE) -> int:
        """Evict at least ``num_blocks`` unreferenced blocks of ``tier`` if there are that many
        (whole runs, so possibly more); returns how many were freed."""
        return self.allocation.evict(tier, num_blocks)

    def can_allocate(self, n: int, path=()) -> bool:
        """Whether ``n`` device slots can be had, evicting as needed, with ``path`` (``peek``'s
        pairs of a match about to be locked) pinned too; changes nothing."""
        return self.allocation.can_allocate(n, path)

    # -- internals -----------------------------------------------------------------------

    def _tokens(self, tokens) -> bytes:
        if type(tokens) is bytes:
            if len(tokens) & 3:
                raise InvalidTokens(f"packed tokens must be a multiple of 4 bytes, got {len(tokens)}")
            return tokens
        try:
            return as_token_bytes(tokens)
        except (ValueError, TypeError) as exc:
            raise InvalidTokens(str(exc)) from None

    def _copy_on_write(self, seq: Sequence, new_slot: int) -> None:
        old_slot = seq.block_table[-1]
        if self.data is not None:
            self.data.copy_within(DEVICE, [old_slot], [new_slot])
        seq.block_table[-1] = new_slot
        self._shared_tail.drop(old_slot)
        self.stats.cow_blocks += 1
        self.events.append(ev.BlockCopied(seq.id, old_slot, new_slot))

    def check_invariants(self, extra_locks=()) -> None:
        """Full consistency check (tests call it after every step; never the hot path).

        ``extra_locks``: nodes locked by holders other than live sequences."""
        from prefixd.cache.invariants import check_cache

        check_cache(self, extra_locks)
