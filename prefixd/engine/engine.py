"""``Engine``: every pool (tenant x KV layout) of one state directory, behind one lock.

On disk::

    <state_dir>/lock                                   the engine's flock (holder's pid inside)
    <state_dir>/pools/<tenant>/<model>-<digest16>/     one DurableCache state directory per pool
        pool.json                                      manifest: tenant, layout bytes, salt print,
                                                       slots per tier (fixed when the pool is made)
        lock, wal/, *.disk.pool                        the pool's own (see DurableCache)

Opening the engine takes the lock, then opens (recovering) every pool found under ``pools/``;
``pool(tenant, layout)`` opens or creates one. The manifest is what makes a pool recoverable
by name: it is written (and fsynced, with its directory entries) before the pool's WAL exists,
so a pool directory either has a manifest or was never used. A pool keeps the slots per tier
its manifest says: its files are sized to the budgets of when it was made (sparse: they take
only what they hold), so a budget changed later bounds its bytes through the ledgers and
never makes its files disagree with their headers.

A pool that holds nothing is closed when the daemon says no session uses it
(``close_empty_pools``, ``prefixd.engine.pool_close``); ``pool`` opens it again.

Composed of: the ``PoolDirectory`` (``prefixd.engine.pool_dir``: where pools live, their
manifests, the pools found on disk), the ``Budgets``, the ``TierLRU`` across the pools, the
``PoolCloser`` and each open pool's ``LogRoom``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

from prefixd.api.layout import KVLayout
from prefixd.config.engine_settings import EngineConfig, Tenant
from prefixd.config.budget_settings import Machine
from prefixd.engine.budgets import Budgets, gpu_total
from prefixd.engine.durable import DurableCache
from prefixd.engine.errors import EngineError, UnknownTenantError
from prefixd.engine.log_room import LogRoom
from prefixd.engine.pool_close import PoolCloser
from prefixd.engine.pool_dir import PoolDirectory
from prefixd.engine.progress import RecoveryProgress
from prefixd.engine.tier_lru import PoolRoom, SharedClock, TierLRU
from prefixd.wal.env import ENV_DIR
from prefixd.wal.lock import StateDirLock

log = logging.getLogger(__name__)


class PoolInfo(NamedTuple):
    """One pool as ``Engine.pools()`` lists it."""

    tenant: str
    layout: KVLayout
    path: str
    num_blocks: tuple[int, int, int]  # indexed blocks resident per tier (device, host, disk)
    capacity: tuple[int, int, int]  # pool sizes in blocks (device, host, disk)


def cache_kwargs(config: EngineConfig, tenant: Tenant) -> dict:
    """The ``DurableCache`` keywords of one pool of ``tenant``, from ``config`` (pool sizes
    come from ``config.blocks_for(layout)``)."""
    kwargs = dict(tenant_salt=tenant.salt, sync=config.sync, sync_interval_ms=config.sync_interval_ms,
                  write_policy=config.write_policy, policy=config.eviction, verify=config.verify,
                  shm_dir=config.shm_dir, reclaim_grace_s=config.reclaim_grace_s,
                  checkpoint_records=config.checkpoint_records, spill_blocks=config.spill_blocks,
                  use_cuda=config.use_cuda, forget_missing_tier=config.forget_missing_tier)
    if config.checkpoint_blocks is not None:  # None: the engine's default
        kwargs["checkpoint_blocks"] = config.checkpoint_blocks
    if config.cluster is not None:  # None: no cluster tier (and nothing of it is imported)
        kwargs["cluster"] = config.cluster
    return kwargs


class Engine:
    """The durable engine of one state directory: one ``DurableCache`` per (tenant, layout).

    Args:
        state_dir: created if missing; holds the engine lock and ``pools/``.
        lock: the state directory's lock, already taken by the caller (the daemon takes it
            before it binds a socket); the engine takes it itself when None.
        progress: counts the log records replayed while the pools recover (read by the
            daemon's Status from another thread).
        config: every setting (default: ``EngineConfig()``). Every pool draws from one byte
            budget per tier (``budgets``, ``prefixd.engine.budgets``); ``config.blocks_for``
            caps one pool's blocks.

    Raises (on open):
        StateLockedError: another engine (in this or another process) holds ``state_dir``; the
            message names its pid.
        PoolDirError: a pool directory cannot be opened as the pool it claims to be.
        and whatever ``DurableCache`` raises while recovering a pool (every pool opened before
        it is closed again, and the lock released).

    Invariants: the lock is held iff the engine is open; ``_pools`` maps (tenant name, layout)
    to an open ``DurableCache`` whose directory is ``pool_path(tenant, layout)`` and holds a
    manifest naming that tenant and layout; no two pools share a shm file name (each pool's
    root seed is its own, and TierStore names its files by root seed and layout digest).

    NOTE: one state subdirectory (own WAL, own pool files) per pool, not one WAL with a pool
    id in every record: see docs/design.md "Several pools".

    Not thread-safe, like ``DurableCache``: one caller at a time.
    """

    def __init__(self, state_dir: str, config: EngineConfig | None = None, *,
                 lock: StateDirLock | None = None,
                 progress: RecoveryProgress | None = None) -> None:
        self.config = config if config is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(self.config).__name__}")
        self.state_dir = os.path.abspath(state_dir)
        self.progress = progress
        # before anything else; a daemon takes it itself before binding its sockets and hands
        # it over (the engine releases it on close either way)
        self._lock: StateDirLock | None = lock if lock is not None else StateDirLock(self.state_dir)
        self._pools: dict[tuple[str, KVLayout], DurableCache] = {}
        self._event_listener = None  # see ``set_event_listener``
        self.directory = PoolDirectory(self.state_dir)  # ``pools/`` and manifests
        self.unconfigured = self.directory.unconfigured  # pool directories of tenants no longer configured
        # one clock for every pool's eviction keys, and one LRU across the pools of a tier
        self.clock = SharedClock()
        self._rooms: dict[tuple[str, KVLayout], PoolRoom] = {}
        self._log_rooms: dict[str, LogRoom] = {}  # by pool directory (``_open`` may run off-thread)
        try:
            self.budgets = Budgets(self.config, self.state_dir,
                                   Machine.probe(self.state_dir, gpu_total(self.config.use_cuda)))
            self.tier_lru = TierLRU(self.budgets.ledgers, self._rooms.items)
            # closes empty pools no session uses (``close_empty_pools``): a pool it closes leaves
            # the maps it shares with the engine (pools, rooms, log rooms); it keeps its counters
            self.closer = PoolCloser(self._pools, self._rooms, self._log_rooms, self.budgets,
                                     self.tier_lru)
            for tenant, layout, sizes in self.directory.found(self.config):
                self._pools[(tenant.name, layout)] = dc = self._open(tenant, layout, sizes)
                self._join(dc, tenant.name, layout)
                self.closer.note((tenant.name, layout))  # an empty one closes once serving
        except BaseException:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the open's own error is the one to raise
                log.exception("closing the pools after a failed open failed too")
            raise
        log.info("engine ready state_dir=%s pools=%d unconfigured=%d", self.state_dir,
                 len(self._pools), len(self.unconfigured))

    # -- pools -------------------------------------------------------------------------------------

    def pool(self, tenant: str, layout: KVLayout) -> DurableCache:
        """The pool of ``tenant`` and ``layout``, created (empty) if it does not exist yet, or
        opened again (recovered) if it was closed.

        Raises:
            UnknownTenantError: ``tenant`` is not in the configuration.
            EngineError: the engine is closed.
        """
        self._check_open()
        dc = self._pools.get((tenant, layout))
        if dc is not None:
            return dc
        self.make_room_for(tenant, layout)
        return self.add_pool(tenant, layout, self.make_pool(tenant, layout))

    def make_pool(self, tenant: str, layout: KVLayout) -> DurableCache:
        """A new pool of ``tenant`` and ``layout``: its manifest and files made (a closed pool:
        opened again, recovering), the pool open, but not yet one of the engine's
        (``add_pool``). Reads only the configuration, so it may run on another thread than the
        engine's callers while they go on; the caller makes sure no two makes of one pool
        overlap and none runs for a pool that exists.

        Raises:
            UnknownTenantError, TypeError: as ``pool``; whatever ``DurableCache`` raises.
        """
        self._check_open()
        conf = self.config.tenant(tenant)
        if conf is None:
            raise UnknownTenantError(tenant, [t.name for t in self.config.tenants])
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        sizes = self.directory.manifest_sizes(conf, layout)  # a closed pool opens as it was made
        if sizes is False:
            sizes = self.budgets.pool_sizes(layout)
            self.directory.write_manifest(conf, layout, sizes)
        return self._open(conf, layout, sizes)

    def make_room_for(self, tenant: str, layout: KVLayout) -> None:
        """Evict the least recently used blocks across the pools of each tier (``TierLRU``)
        until a new pool of ``tenant`` and ``layout`` finds its first extents in the budgets;
        on the engine's thread, before ``make_pool`` (which then charges them)."""
        self._check_open()
        for tier, nbytes in enumerate(self.budgets.first_extents(layout)):
            if nbytes:
                self.tier_lru.make_room_bytes(tenant, tier, nbytes)

    def add_pool(self, tenant: str, layout: KVLayout, dc: DurableCache) -> DurableCache:
        """Make ``dc`` (from ``make_pool``) the engine's pool of ``tenant`` and ``layout``."""
        self._check_open()
        if (tenant, layout) in self._pools:
            raise EngineError(f"a pool of tenant {tenant!r} and model {layout.model_id!r} "
                              f"exists already: make each pool once")
        self._pools[(tenant, layout)] = dc
        self.closer.reopened((tenant, layout), dc)  # a closed pool's counters carry on
        self._join(dc, tenant, layout)
        self._listen(dc, tenant, layout)
        log.info("pool created tenant=%s model=%s path=%s", tenant, layout.model_id,
                 self.pool_path(tenant, layout))
        return dc

    def pools(self) -> list[PoolInfo]:
        """Every open pool, sorted by tenant then model id."""
        self._check_open()
        out = []
        for (tenant, layout), dc in sorted(self._pools.items(),
                                           key=lambda kv: (kv[0][0], kv[0][1].to_bytes())):
            capacity = tuple(a.num_slots if a is not None else 0 for a in dc.cache.allocators)
            out.append(PoolInfo(tenant, layout, dc.state_dir,
                                tuple(dc.cache.tree.num_blocks_in), capacity))
        return out

    def pool_items(self) -> list[tuple[tuple[str, KVLayout], DurableCache]]:
        """Every open pool as ``((tenant, layout), cache)``, in no particular order."""
        self._check_open()
        return list(self._pools.items())

    def set_event_listener(self, listener) -> None:
        """Have ``listener(tenant, layout, events)`` called with every batch of cache events
        (``prefixd.cache.events``) of every pool, open now or opened later, once the batch is
        logged; on the caller's thread, inside the engine call that made them, so it must be
        O(events) and must not raise. None stops it. (Events of a recovery come before.)"""
        self._event_listener = listener
        for (tenant, layout), dc in self._pools.items():
            self._listen(dc, tenant, layout)

    def _join(self, dc: DurableCache, tenant: str, layout: KVLayout) -> None:
        """Make ``dc`` one of the pools whose eviction keys and tier budgets are shared."""
        dc.shared_clock = self.clock
        self.clock.enter(dc.cache.tree)
        self.clock.leave(dc.cache.tree)
        self._rooms[(tenant, layout)] = PoolRoom(tenant, dc)
        dc.cache.on_tier_full = functools.partial(self.tier_lru.make_room, (tenant, layout))

    def _listen(self, dc: DurableCache, tenant: str, layout: KVLayout) -> None:
        listener = self._event_listener
        dc.event_listener = (None if listener is None
                             else functools.partial(listener, tenant, layout))

    def pool_path(self, tenant: str, layout: KVLayout) -> str:
        """Where the pool of ``tenant`` and ``layout`` lives (whether or not it exists)."""
        return self.directory.path(tenant, layout)

    def note_unused(self, tenant: str, layout: KVLayout) -> None:
        """The last session using the pool of ``tenant`` and ``layout`` ended: try to close it
        at the next ``close_empty_pools``."""
        self.closer.note((tenant, layout))

    def closed_pools(self, tenant: str) -> list[KVLayout]:
        """The layouts of ``tenant``'s pools closed while empty: their files stay, the next
        Attach with one reopens it, and each still counts as one of the tenant's pools."""
        return [layout for t, layout in self.closer.closed_stats if t == tenant]

    def close_empty_pools(self, used, busy=None) -> list[tuple[str, KVLayout]]:
        """Close every candidate pool that holds nothing and that no session uses; returns the
        keys closed (``PoolCloser.close_empty_pools``: ``used`` and ``busy`` there)."""
        self._check_open()
        return self.closer.close_empty_pools(used, busy)

    # -- periodic work -----------------------------------------------------------------------------

    def tick(self) -> None:
        """Every pool's periodic work (spill, expire unclaimed recovered sequences). Every pool
        is ticked even if one fails; the first failure is raised after. A pool whose last
        recovered sequences expired here becomes a candidate to close: no session end names
        it, since no session used it."""
        self._check_open()

        def one(key, dc):
            waiting = bool(dc.recovered)
            dc.tick()
            if waiting and not dc.recovered:
                self.closer.note(key)

        try:
            self._each(one, with_key=True)
        finally:
            for dc in self._pools.values():  # the logs' room follows them as they grow
                room = self._log_rooms.get(dc.state_dir)
                if room is not None:
                    room.keep(dc.upkeep.checkpoint_bytes)
            self.budgets.watch_space((f"{t}/{layout.model_id}", dc.store)
                                     for (t, layout), dc in self._pools.items())

    def checkpoint(self) -> dict[tuple[str, KVLayout], int]:
        """Checkpoint every pool; returns each pool's checkpoint lsn."""
        self._check_open()
        lsns = {}

        def one(key, dc):
            lsns[key] = dc.checkpoint()

        self._each(one, with_key=True)
        return lsns

    def close(self) -> None:
        """Close every pool (no checkpoint), then release the lock. Idempotent; every pool is
        closed even if one fails, and the first failure is raised after."""
        if self._lock is None:
            return
        try:
            self._each(lambda dc: dc.close())
        finally:
            for room in self._log_rooms.values():
                room.release()
            self._log_rooms.clear()
            self._pools.clear()
            self._rooms.clear()
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        self._check_open()
        self._lock.check_invariants()
        names = set()
        for (tenant, layout), dc in self._pools.items():
            assert dc.state_dir == self.pool_path(tenant, layout), (dc.state_dir, tenant)
            assert dc.layout == layout
            assert dc.store.name not in names, f"two pools share shm file name {dc.store.name}"
            names.add(dc.store.name)
            dc.check_invariants()
        self.budgets.check_invariants()
        self.closer.check_invariants()

    # -- internals ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._lock is None:
            raise EngineError(f"the engine of {self.state_dir} is closed: open a new Engine")

    def _each(self, fn, *, with_key: bool = False) -> None:
        first = None
        for key, dc in list(self._pools.items()):
            try:
                fn(key, dc) if with_key else fn(dc)
            except Exception as exc:  # noqa: BLE001 - raised below, after the other pools
                log.error("pool failed tenant=%s model=%s error=%r", key[0], key[1].model_id, exc)
                first = first or exc
        if first is not None:
            raise first

    def _open(self, tenant: Tenant, layout: KVLayout, sizes) -> DurableCache:
        """Open (recovering) the pool; ``sizes`` in slots per tier, as its manifest says (None:
        a manifest from before budgets, sized by the budgets now)."""
        sizes = sizes or self.budgets.pool_sizes(layout)
        sizes = self.budgets.opening(tenant.name, layout, sizes)  # a GPU pool: what is left
        os.makedirs(self.config.shm_dir, exist_ok=True)
        dc = DurableCache(self.pool_path(tenant.name, layout), layout, sizes,
                          progress=self.progress, ledgers=self.budgets.by_tier(),
                          tenant=tenant.name, **cache_kwargs(self.config, tenant))
        try:
            room = self.budgets.log_room(tenant.name, os.path.join(dc.state_dir, ENV_DIR, "data.mdb"))
        except BaseException:
            dc.close()
            raise
        self._log_rooms[dc.state_dir] = room
        return dc
