"""KV events on ZMQ in vLLM's wire format (``prefixd.daemon.kv_wire``), one publisher per tenant.

The engine's listener (``Engine.set_event_listener``, beside the ``SubscribeEvents`` journal)
hands each logged batch of cache events to ``KVPublishers.observe`` on the loop's thread. It
only notes them (the tenant's ``TenantPublisher.pending``) and a callback (``flush``, at most
``FLUSH_S`` after the first note: every loop turn in between shares the batch) turns each
tenant's notes into one ``KVEventBatch`` and sends it:

- ``BlocksStored`` (a commit): ``BlockStored`` on ``"GPU"`` with the run's parent hash (nil
  under a namespace root), token ids and block size;
- ``BlocksMoved`` (a copy landed in a tier: write-through, demotion, promotion):
  ``BlockStored`` on that tier's medium, with the parent and token ids of the run the blocks
  entered the index with (``prefixd.daemon.kv_lineage``; so a router may keep a tree per
  medium); should that run be unknown, the hashes alone, as vLLM's offloading connector's
  placeholder stores;
- ``BlocksDropped`` (eviction, the tier's copy given up after a demotion, a corrupt disk run
  cut off): ``BlockRemoved`` on that medium.

At a start, before any live batch: ``AllBlocksCleared``, then the recovered index (``index``):
every resident run as ``BlockStored`` on each medium that holds it, parents first, with parent
and token ids. Sequence numbers start at the start's wall clock in microseconds and rise by one a
batch: a subscriber that saw an earlier start sees them jump forward, so it asks for a replay
(from its last number plus one) and gets this start's batches from the first, ``AllBlocksCleared``
included.

NOTE (a slow subscriber never slows the daemon): the PUB socket never blocks. Its
``XPUB_NODROP`` makes a send that some subscriber's queue (``hwm`` batches) cannot take fail
at once instead of vanishing: the batch is counted ``dropped`` and kept in the replay buffer
like any other, so every subscriber sees the gap in the numbers and replays it. The replay
buffer holds the last ``buffer_batches`` payloads; replays are served by one thread
(``prefixd.daemon.kv_replay``), never the loop. A subscriber that stops reading is cut off by
ZMTP heartbeats (``HEARTBEAT_TIMEOUT_MS``), so its full queue does not drop batches for long.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time

import zmq

from prefixd.cache.events import BlocksDropped, BlocksMoved, BlocksStored
from prefixd.cache.node import DEVICE
from prefixd.daemon import kv_wire as wire
from prefixd.daemon.kv_lineage import Lineage
from prefixd.daemon.kv_replay import ReplayServer

log = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
SNAPSHOT_EVENTS = 512  # events per batch of the recovered index at a start
# NOTE: a batch goes out at most this long after its first event, with every event of the
# loop turns in between: each send wakes ZMQ's I/O thread when it sleeps, ~50 us of the loop's
# CPU a batch on a small virtual machine (7 us back to back), so under load the requests of
# several milliseconds share one; a router sees a commit within ~FLUSH_S (the lag target: 50
# ms). Under bench/events.py (8 gsp clients, host load 7-10) the loop spent 70 us a request
# here at 10 ms, 49-69 us at 20 ms (5 runs; lag p99 19-25 ms): docs/bench/events.json
FLUSH_S = 0.020
_MORE = zmq.NOBLOCK | zmq.SNDMORE
_clock = time.thread_time_ns  # CPU time: what the loop spends, not what the host steals


class TenantPublisher:
    """One tenant's PUB socket, numbers, replay buffer and the events of the coming batch.

    Fields: ``pending`` (notes ``(cache events, block size, radix tree)``, the coming
    batch's, turned into wire events only at the flush, in one pass), ``buffer``
    (``(seq, payload)`` of the last ``buffer_batches`` batches, read by the replay thread),
    ``lineage`` (``kv_lineage``),
    counters ``batches``, ``dropped``, ``stored[tier]`` and ``removed[tier]`` (blocks).
    Touched on the loop's thread only, ``buffer`` excepted.
    """

    def __init__(self, ctx, ends, buffer_batches: int, hwm: int, first_seq: int) -> None:
        self.tenant = ends.tenant
        self.endpoint = ends.endpoint
        self.replay_endpoint = ends.replay_endpoint
        self.topic = ends.topic.encode()
        self.hashes = wire.ExternalHashes(ends.tenant)
        self.buffer: collections.deque = collections.deque(maxlen=buffer_batches)
        self.pending: list = []
        self.lineage = Lineage(self.hashes)  # each indexed run, packed once (``kv_lineage``)
        self.next_seq = first_seq
        self.batches = self.dropped = 0
        self.hwm = hwm
        self.stored = [0, 0, 0]
        self.removed = [0, 0, 0]
        self.pub = ctx.socket(zmq.PUB)
        self.replay = None
        try:
            for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, hwm), (zmq.XPUB_NODROP, 1),
                               (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
                               (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)):
                self.pub.setsockopt(opt, value)
            _bind(self.pub, self.endpoint, self.tenant)
            if self.replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.setsockopt(zmq.SNDHWM, buffer_batches + 1)  # a whole replay fits
                _bind(self.replay, self.replay_endpoint, self.tenant)
        except BaseException:
            self.close()
            raise

    def send(self, batch: wire.Batch) -> int:
        """Number, send (or count dropped) and keep one batch; returns its number."""
        seq = self.next_seq
        self.next_seq = seq + 1
        payload = batch.encode()
        self.buffer.append((seq, payload))
        self.batches += 1
        try:  # NOTE: a frame a call, not send_multipart: its Python loop costs more than these
            send = self.pub.send
            send(self.topic, _MORE)  # the first frame fails (Again) or the message goes whole
            send(wire.seq_bytes(seq), _MORE)
            send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: a slow subscriber
                log.warning("kv events batch dropped (a subscriber's queue of %d batches is "
                            "full; it replays the gap) tenant=%s seq=%d dropped=%d", self.hwm,
                            self.tenant, seq, self.dropped)
        return seq

    def events(self, roots_of) -> wire.Batch:
        """The pending notes as one batch of wire events (and counted); ``pending`` emptied.
        ``roots_of(tree)``: the hashes of the tree's namespace roots (a run under one has no
        parent block)."""
        batch = wire.Batch()
        stored, removed = self.stored, self.removed
        lineage = self.lineage
        one = self.hashes.one
        mediums = wire.MEDIUMS
        gpu = mediums[DEVICE]
        for events, bs, tree in self.pending:
            roots = None
            for e in events:
                t = type(e)
                if t is BlocksStored:
                    if roots is None:
                        roots = roots_of(tree)
                    parent = None if e.parent_hash in roots else one(e.parent_hash)
                    run = lineage.add(e.hashes, parent, e.tokens, bs)
                    stored[DEVICE] += len(e.hashes)
                    batch.stored(run.fields, gpu)
                elif t is BlocksMoved:
                    stored[e.tier] += len(e.hashes)
                    batch.stored(lineage.fields(e.hashes, bs), mediums[e.tier])
                elif t is BlocksDropped:
                    removed[e.tier] += len(e.hashes)
                    batch.removed(lineage.packed(e.hashes), mediums[e.tier])
                    if e.forgotten:
                        lineage.forget(e.hashes)
        self.pending = []
        return batch

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)


class KVPublishers:
    """Every tenant's ``TenantPublisher`` and the engine listener that feeds them; None of it
    exists while ``[daemon.kv_events]`` has no endpoint (``create``)."""

    def __init__(self, config, tenants: list[str]) -> None:
        self.ctx = zmq.Context()
        # ZMQ's I/O thread wakes at every batch: as SCHED_BATCH it never preempts the loop's
        # thread on its wake-up (the scheduler treats it as a batch job; it still gets its share)
        self.ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        self.ctx.set(zmq.THREAD_PRIORITY, 0)
        first_seq = time.time_ns() // 1000
        self.by_tenant: dict[str, TenantPublisher] = {}
        try:
            for ends in config.tenants(tenants):
                self.by_tenant[ends.tenant] = TenantPublisher(
                    self.ctx, ends, config.buffer_batches, config.hwm, first_seq)
        except BaseException:
            self.close()
            raise
        self.replays = ReplayServer(self.ctx, [p for p in self.by_tenant.values() if p.replay is not None])
        self._loop = None
        self._engine = None
        self._timer = None  # the flush to come, while one is scheduled
        # the loop's CPU time in ``flush`` (a metric: the cost; ``observe``, a few appends a
        # cache call, is not timed: reading a thread's CPU clock is a system call)
        self.busy_ns = 0
        self._roots: dict[int, tuple[int, frozenset]] = {}  # id(tree) -> (len(roots), hashes)
        # (tenant, id(layout)) -> (layout, block size, its pool's radix tree): the engine hands
        # each pool's events with one layout object, whose dataclass hash costs more than the
        # note; the entry holds the layout, so its id is not reused while the entry lives; a
        # pool closed empty leaves by ``forget_pool``, and its reopening brings a new tree)
        self._trees: dict = {}
        log.info("kv events publishing endpoints=%s",
                 ",".join(p.endpoint for p in self.by_tenant.values()))

    @classmethod
    def create(cls, config, tenants: list[str]) -> "KVPublishers | None":
        """The publishers of ``config`` (``KVEventsConfig``) bound, or None when it is off.

        Raises ConfigError, zmq.ZMQError: an endpoint cannot be bound.
        """
        return cls(config, tenants) if config.enabled else None

    def items(self):
        return sorted(self.by_tenant.items())

    # -- the start -------------------------------------------------------------------------

    async def start(self, engine) -> None:
        """Publish ``AllBlocksCleared`` and the recovered index of every pool, then go live.

        NOTE: before the daemon serves, so nothing changes the trees meanwhile; it yields to
        the loop after each batch, so that Status, health and the watchdog still answer while
        a large index goes out."""
        self._loop = asyncio.get_running_loop()
        self._engine = engine
        for pub in self.by_tenant.values():
            batch = wire.Batch()
            batch.cleared()
            pub.send(batch)
        counts = dict.fromkeys(self.by_tenant, 0)
        for (tenant, layout), dc in sorted(engine.pool_items(), key=lambda kv: kv[0][0]):
            pub = self.by_tenant.get(tenant)
            if pub is None:
                continue
            counts[tenant] += await self._index(pub, dc.cache.tree, layout.block_size)
        self.replays.start()
        log.info("kv events: published the recovered index blocks=%s",
                 ",".join(f"{t}:{n}" for t, n in sorted(counts.items())))

    async def _index(self, pub: TenantPublisher, tree, block_size: int) -> int:
        """Every resident run of ``tree``, parents first, as batches of ``BlockStored``."""
        ext, batch, blocks = pub.hashes, wire.Batch(), 0
        for node in tree.nodes():
            parent = None if node.parent.is_root() else ext.one(node.parent.last_hash)
            run = pub.lineage.add(node.hashes, parent, node.tokens, block_size)
            for tier, slots in enumerate(node.slots):
                if slots is None:
                    continue
                batch.stored(run.fields, wire.MEDIUMS[tier])
                pub.stored[tier] += len(node.hashes)
                blocks += len(node.hashes)
            if batch.num_events >= SNAPSHOT_EVENTS:
                pub.send(batch)
                batch = wire.Batch()
                await asyncio.sleep(0)
        if batch.num_events:
            pub.send(batch)
        return blocks

    # -- live ------------------------------------------------------------------------------

    def observe(self, tenant: str, layout, events) -> None:
        """Note one logged batch of cache events of ``tenant``'s pool of ``layout``; a flush is
        scheduled ``FLUSH_S`` on, unless one is. Never raises into the engine call.

        NOTE: a note is an append, the events looked at only at the flush (in one pass, which
        skips what no router is told): the engine calls this for every batch it logs."""
        pub = self.by_tenant.get(tenant)
        if pub is None or self._loop is None:
            return
        try:
            known = self._trees.get((tenant, id(layout)))
            if known is None or known[0] is not layout:
                tree = self._engine.pool(tenant, layout).cache.tree
                known = self._trees[(tenant, id(layout))] = (layout, layout.block_size, tree)
            pub.pending.append((events, known[1], known[2]))
            if self._timer is None:
                self._timer = self._loop.call_later(FLUSH_S, self.flush)
        except Exception:  # noqa: BLE001 - a router's view must never fail a cache call
            log.exception("kv events of a batch lost tenant=%s model=%s", tenant,
                          layout.model_id)

    def forget_pool(self, tree) -> None:
        """Drop what is kept of a closed pool's ``tree`` (it held no block: nothing to say).
        Its pending events go out first, at the flush that ``tree`` still serves."""
        if any(tree is t for pub in self.by_tenant.values() for _, _, t in pub.pending):
            if self._timer is not None:
                self._timer.cancel()
            self.flush()
        self._trees = {k: v for k, v in self._trees.items() if v[2] is not tree}
        self._roots.pop(id(tree), None)

    def _root_hashes(self, tree) -> frozenset:
        """The hashes of ``tree``'s namespace roots (roots are only ever added)."""
        known = self._roots.get(id(tree))
        if known is None or known[0] != len(tree.roots):
            known = (len(tree.roots), frozenset(r.hashes[0] for r in tree.roots.values()))
            self._roots[id(tree)] = known
        return known[1]

    def flush(self) -> None:
        """One ``KVEventBatch`` per tenant with events since the last flush."""
        self._timer = None
        t0 = _clock()
        for pub in self.by_tenant.values():
            if not pub.pending:
                continue
            try:
                batch = pub.events(self._root_hashes)
                if batch.num_events:
                    pub.send(batch)
            except Exception:  # noqa: BLE001 - the next batch still goes out
                pub.pending = []
                log.exception("kv events batch lost tenant=%s", pub.tenant)
        self.busy_ns += _clock() - t0

    def close(self) -> None:
        """Stop the replay thread and close every socket (a last flush first)."""
        if getattr(self, "replays", None) is not None:
            self.replays.stop()
            if self._timer is not None:
                self._timer.cancel()
                self.flush()
            self._loop = None  # a late note is ignored
        for pub in self.by_tenant.values():
            pub.close()
        self.ctx.term()


def _bind(sock, endpoint: str, tenant: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"kv events of tenant {tenant!r}: cannot bind {endpoint} "
                                 f"({exc}): another process holds it? choose another endpoint "
                                 f"in [daemon.kv_events]") from None

