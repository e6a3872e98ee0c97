"""The KV-event journal: blocks stored / removed per tier, numbered, per tenant, for routers.

A KV-aware router (llm-d, Dynamo) keeps a map of which host holds which prefix blocks, fed by
events like vLLM's ``BlockStored`` / ``BlockRemoved``. The engine already produces every such
change as a cache event (``prefixd.cache.events``: ``BlocksStored`` at a commit,
``BlocksMoved`` into a tier, ``BlocksDropped`` out of one, eviction included); the daemon's
listener (``Engine.set_event_listener``) hands each logged batch to ``EventJournals.observe``
on the loop's thread, which turns it into ``JournalEntry`` values of the pool's tenant:

- ``stored`` in ``tier`` for ``BlocksStored`` (device, with the run's parent hash and token
  ids, as vLLM's ``BlockStored``) and ``BlocksMoved`` (a copy landed in that tier: demotion,
  write-through, promotion);
- ``removed`` from ``tier`` for ``BlocksDropped`` (eviction from any tier, a corrupt disk
  block cut off).

Every entry of a tenant gets the next sequence number (1, 2, ...; they restart with the
daemon, whose ``epoch`` every event carries). The journal keeps the last ``ring_size`` in a
ring, so a subscriber that reconnects with the last number it received gets every event after
it; one that asks for more than the ring holds (or names another epoch) gets a ``cleared``
event first (see ``EventJournal.subscribe`` and docs/design.md "KV events for routers").

NOTE (a subscriber is a cursor, not a copy): an entry is immutable and shared; a subscriber
is the number of the next entry it will be sent, read out of the ring. Its queue is the ring
segment between its cursor and the newest entry, bounded by ``subscriber_queue`` once it has
caught up: past that it is cut off (``overflowed``), and its stream ends RESOURCE_EXHAUSTED
so that it resumes from the ring. So memory is the ring's, whatever the number of
subscribers, and an append is O(blocks + subscribers) on the loop: no copy per subscriber,
nothing that waits for a slow reader.

NOTE (the replay's slack): a new stream is offered the newest ``ring_size`` entries, but the
ring keeps ``subscriber_queue`` more. Without them a stream that replays from the oldest
entry offered (``from_sequence_number`` 0, or after ``cleared``) would be cut off by the
first append that came before its first send; under steady traffic its resubscription
would begin at the oldest again, and be cut off again, for ever. With them a replay may fall
``subscriber_queue`` appends behind, as a live subscriber may.

Recovery's reconciliation drops blocks without events (``prefixd.engine.reconcile``), before
the journal exists; a router learns of it by the epoch: every stream after a restart begins
with ``cleared``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from prefixd.api.tiers import TIER_NAMES
from prefixd.cache.events import BlocksDropped, BlocksMoved, BlocksStored

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


class JournalEntry(NamedTuple):
    """One event as sent (``prefixd.v1.KVEvent``): a run of blocks of one pool."""

    sequence_number: int
    kind: str  # STORED, REMOVED or CLEARED
    tier: str  # "device", "host", "disk" (the api Tier vocabulary; "cluster" later); "" cleared
    model_id: str
    block_size: int
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes = b""  # STORED at commit: the run's parent
    tokens: bytes = b""  # the same: packed int32 token ids of the run


_new_entry = tuple.__new__


def tier_name(tier) -> str:
    """A tier as the api names it: an int of the cache core, or already a name."""
    if isinstance(tier, str):
        return tier
    return TIER_NAMES[tier] if 0 <= tier < len(TIER_NAMES) else f"tier{tier}"


class Subscriber:
    """One stream's position: ``cursor`` is the number of the next entry to send.

    ``live``: it has caught up with the journal once (from then on it may lag at most
    ``subscriber_queue`` entries); ``overflowed`` / ``closed``: the stream must end
    (RESOURCE_EXHAUSTED / UNAVAILABLE); ``wake`` is set when any of these may have changed.
    ``cleared``: the ``cleared`` entry to send first, or None.
    """

    __slots__ = ("cursor", "live", "overflowed", "closed", "wake", "cleared", "sent")

    def __init__(self, cursor: int, cleared: JournalEntry | None) -> None:
        self.cursor = cursor
        self.cleared = cleared
        self.live = False
        self.overflowed = False
        self.closed = False
        self.sent = 0
        self.wake = asyncio.Event()


class EventJournal:
    """One tenant's numbered KV events, the last ``ring_size`` of them kept, and its subscribers.

    Data structure: ``_ring`` is a list of ``capacity = ring_size + queue_limit`` slots; entry
    number ``n`` lives in slot ``n % capacity`` while ``kept <= n < next_sequence_number``.
    A new subscriber is offered the entries from ``oldest`` (the newest ``ring_size``); the
    ``queue_limit`` kept before them are the slack of a replay begun at ``oldest``.

    Invariants: ``next_sequence_number - oldest == min(emitted, ring_size)``, ``kept <=
    oldest``; every kept entry's ``sequence_number`` matches its slot; every subscriber in
    ``_subscribers`` is neither overflowed nor closed, its cursor ``<= next_sequence_number``,
    and a live one lags by at most ``queue_limit``. Touched on the loop's thread only.
    """

    def __init__(self, tenant: str, epoch: int, ring_size: int, queue_limit: int) -> None:
        if ring_size < 1 or queue_limit < 1:
            raise ValueError(f"ring_size and queue_limit must be >= 1, got {ring_size}, {queue_limit}")
        self.tenant = tenant
        self.epoch = epoch
        self.ring_size = ring_size
        self.queue_limit = queue_limit
        self.capacity = ring_size + queue_limit
        self._ring: list[JournalEntry | None] = [None] * self.capacity
        self.next_sequence_number = 1
        self._subscribers: set[Subscriber] = set()
        self.emitted = 0
        self.overflows = 0
        self.gaps = 0  # streams begun with ``cleared``

    @property
    def oldest(self) -> int:
        """The number of the oldest entry held (``next_sequence_number`` when none is)."""
        return max(1, self.next_sequence_number - self.ring_size)

    @property
    def kept(self) -> int:
        """The number of the oldest entry still in the ring (a replay may still read it)."""
        return max(1, self.next_sequence_number - self.capacity)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # -- writing ---------------------------------------------------------------------------------

    def observe(self, layout, events) -> None:
        """Append the KV events of one batch of cache events of the pool of ``layout``."""
        model, bs = layout.model_id, layout.block_size
        for e in events:
            t = type(e)
            if t is BlocksStored:
                self.append(STORED, "device", model, bs, tuple(e.hashes), e.parent_hash,
                            bytes(e.tokens))
            elif t is BlocksMoved:
                self.append(STORED, tier_name(e.tier), model, bs, tuple(e.hashes))
            elif t is BlocksDropped:
                self.append(REMOVED, tier_name(e.tier), model, bs, tuple(e.hashes))

    def append(self, kind: str, tier: str, model_id: str, block_size: int,
               block_hashes: tuple[bytes, ...], parent_block_hash: bytes = b"",
               tokens: bytes = b"") -> JournalEntry:
        """Number and keep one event, wake the subscribers, cut off those too far behind."""
        n = self.next_sequence_number
        # NOTE: ``tuple.__new__`` as ``prefixd.cache.events.new_event``: a NamedTuple's own
        # ``__new__`` costs ~3x more, and a gsp request appends ~6 entries
        entry = _new_entry(JournalEntry, (n, kind, tier, model_id, block_size, block_hashes,
                                          parent_block_hash, tokens))
        self._ring[n % self.capacity] = entry
        self.next_sequence_number = n + 1
        self.emitted += 1
        limit = n + 1 - self.queue_limit
        cut = None
        for sub in self._subscribers:
            if sub.live and sub.cursor < limit:
                cut = cut or []
                cut.append(sub)
            sub.wake.set()
        if cut:
            for sub in cut:
                self._overflow(sub)
        return entry

    # -- reading ---------------------------------------------------------------------------------

    def subscribe(self, from_sequence_number: int, epoch: int = 0) -> Subscriber:
        """A subscriber positioned after ``from_sequence_number`` (the last number its router
        received; 0: from the oldest entry held).

        It begins with a ``cleared`` entry (``Subscriber.cleared``) when the events after
        that number cannot all be sent: ``epoch`` (non-zero) is not this daemon's, the number
        is newer than any sent (so from an earlier daemon), or the ring no longer holds the
        one after it. ``cleared`` carries the number before the first entry that follows, so
        numbers stay consecutive on the stream; it is then positioned at the oldest entry held.
        """
        oldest, nxt = self.oldest, self.next_sequence_number
        start = from_sequence_number + 1
        if epoch and epoch != self.epoch:
            reason = "another daemon start"
        elif from_sequence_number == 0:
            reason, start = None, oldest
        elif start > nxt:
            reason = "a number this daemon never sent"
        elif start < oldest:
            reason = "older than the ring holds"
        else:
            reason = None
        cleared = None
        if reason is not None:
            start = oldest
            cleared = JournalEntry(start - 1, CLEARED, "", "", 0, ())
            self.gaps += 1
            log.info("event subscriber starts with cleared tenant=%s from=%d epoch=%#x reason=%s "
                     "oldest=%d", self.tenant, from_sequence_number, epoch, reason, oldest)
        sub = Subscriber(start, cleared)
        self._subscribers.add(sub)
        return sub

    def next_entry(self, sub: Subscriber) -> JournalEntry | None:
        """The next entry for ``sub`` (its cursor advanced), or None when it has caught up.
        A subscriber whose next entry the ring dropped while it replayed (more than
        ``queue_limit`` appends past the oldest entry offered) is cut off (None,
        ``overflowed`` set)."""
        if sub.overflowed or sub.closed:
            return None
        if sub.cleared is not None:
            entry, sub.cleared = sub.cleared, None
            return entry
        n = sub.cursor
        if n >= self.next_sequence_number:
            sub.live = True
            return None
        if n < self.kept:
            self._overflow(sub)
            return None
        sub.cursor = n + 1
        sub.sent += 1
        return self._ring[n % self.capacity]

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)

    def close(self) -> None:
        """The daemon stops: every stream must end (UNAVAILABLE)."""
        for sub in list(self._subscribers):
            sub.closed = True
            sub.wake.set()
        self._subscribers.clear()

    def _overflow(self, sub: Subscriber) -> None:
        sub.overflowed = True
        sub.wake.set()
        self._subscribers.discard(sub)
        self.overflows += 1
        log.warning("event subscriber cut off (too far behind) tenant=%s next=%d newest=%d "
                    "limit=%d", self.tenant, sub.cursor, self.next_sequence_number - 1,
                    self.queue_limit)

    def check_invariants(self) -> None:
        nxt, oldest, kept = self.next_sequence_number, self.oldest, self.kept
        assert nxt - oldest == min(self.emitted, self.ring_size), (nxt, oldest, self.emitted)
        assert kept <= oldest and nxt - kept == min(self.emitted, self.capacity)
        for n in range(kept, nxt):
            assert self._ring[n % self.capacity].sequence_number == n
        for sub in self._subscribers:
            assert not sub.overflowed and not sub.closed and sub.cursor <= nxt
            assert not sub.live or nxt - sub.cursor <= self.queue_limit, (sub.cursor, nxt)


class EventJournals:
    """Every tenant's ``EventJournal`` (one per tenant, so that no tenant's events, numbers
    or lag ever reach another's socket), and the engine's listener that feeds them."""

    def __init__(self, tenants, epoch: int, ring_size: int, queue_limit: int) -> None:
        self.epoch = epoch
        self._journals = {t: EventJournal(t, epoch, ring_size, queue_limit) for t in tenants}

    def journal(self, tenant: str) -> EventJournal:
        return self._journals[tenant]

    def items(self):
        return sorted(self._journals.items())

    def observe(self, tenant: str, layout, events) -> None:
        """``Engine.set_event_listener``'s listener: never raises into the engine call."""
        journal = self._journals.get(tenant)
        if journal is None:
            return
        try:
            journal.observe(layout, events)
        except Exception:  # noqa: BLE001 - a router's view must never fail a cache call
            log.exception("KV events of a batch lost tenant=%s model=%s", tenant, layout.model_id)

    def close(self) -> None:
        for journal in self._journals.values():
            journal.close()

    def check_invariants(self) -> None:
        for journal in self._journals.values():
            journal.check_invariants()
