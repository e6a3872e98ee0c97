"""``Budgets``: the bytes per tier the whole engine may take, shared by every pool.

At start the engine resolves ``[engine.budget]`` and each tenant's ``max`` / ``reserved``
against this host (``Budget.resolve``, ``Machine.probe``) and makes one ``BudgetLedger`` per tier;
every pool (tenant x layout) of a tier is charged in that one ledger, under its tenant.

The log's room comes first: the disk ledger keeps ``log_reserve`` bytes out of what pools may
take, ``max(LOG_FLOOR, 2 x the logs on disk at start + checkpoint_records x MEAN_RECORD_BYTES)``:
LMDB's map grows by what is appended until a checkpoint folds it, and a checkpoint is written
beside the one it replaces. A start whose filesystem has less free space than the log's room
not yet taken is refused (``NoRoomForLogError``, one line naming the filesystem and the bytes).
Each pool's log file also keeps room past its end with its blocks allocated, at least
``LOG_POOL_ROOM`` charged to its tenant, kept as the log grows and sized to a checkpoint
(``log_room``, ``prefixd.engine.log_room``): another process filling the filesystem then
meets the pool files' grows (refused, the cache keeps serving from memory), not the log's
commits or checkpoints.

A pool's size per tier is ``min([engine.blocks] cap, (tier budget - header) // block_bytes)``
slots when it is made (its manifest keeps them: ``prefixd.engine.engine``): its files are sparse, as large as the budget, and take bytes extent by extent as
blocks arrive (``prefixd.storage.extents``), charged in the tier's ledger under the pool's
tenant by its ``TierStore``. An Attach is admitted only if one request of the client's
``max_model_len`` (or one block) fits every tier within what its tenant may ever hold there
(``refusal``), and no file is made whose header extent the ledger cannot take.
"""

from __future__ import annotations

import logging
import os
import time

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import TIER_NAMES, Tier
from prefixd.config.budget_settings import Budget, Machine, filesystem_bytes
from prefixd.config.engine_settings import EngineConfig
from prefixd.config.errors import ConfigError
from prefixd.config.sizes import format_bytes
from prefixd.engine.errors import EngineError
from prefixd.engine.log_room import LOG_POOL_ROOM, LogRoom, LogRooms  # noqa: F401 - LOG_POOL_ROOM: here too
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import BudgetExceededError
from prefixd.storage.extents import EXTENT_BYTES
from prefixd.storage.poolfile import DATA_OFFSET

log = logging.getLogger(__name__)

MiB = 1 << 20
UNCAPPED = 1 << 62  # no [engine.blocks] cap: the budget alone sizes a pool
LOG_FLOOR = 64 * MiB
MEAN_RECORD_BYTES = 256  # a commit record of a gsp request with its hashes (bench/engine.py)
SPACE_CLEAR_S = 5.0  # no ENOSPC this long: the filesystem counts as having room again


class NoRoomForLogError(EngineError):
    """The state directory's filesystem has too little free space for the log's room."""

    def __init__(self, where: str, need: int, free: int) -> None:
        super().__init__(f"the filesystem of {where} has {format_bytes(free)} free and the log "
                         f"needs {format_bytes(need)} more ({need} bytes): free space there, or "
                         f"move --state-dir to a filesystem with room")
        self.where, self.need, self.free = where, need, free


def _extents(nbytes: int) -> int:
    """``nbytes`` rounded up to whole extents: what a sparse file takes for them."""
    return -(-nbytes // EXTENT_BYTES) * EXTENT_BYTES


def pool_file_bytes(num_slots: int, block_bytes: int) -> int:
    """What one tier's pool file of ``num_slots`` blocks takes, header included."""
    return DATA_OFFSET + num_slots * block_bytes if num_slots else 0


def log_bytes_on_disk(state_dir: str) -> int:
    """Bytes the pools' logs (every ``wal`` directory under ``pools/``) take now."""
    return bytes_under(os.path.join(state_dir, "pools"), only_dirs_named="wal")


def bytes_under(path: str, only_dirs_named: str | None = None) -> int:
    """Bytes the files under ``path`` take on disk (``st_blocks``), or only those in
    directories named ``only_dirs_named``; a file gone meanwhile counts nothing."""
    total = 0
    for dirpath, _, files in os.walk(path):
        if only_dirs_named is not None and os.path.basename(dirpath) != only_dirs_named:
            continue
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


class Budgets:
    """The resolved budget, one ledger per tier, and what each open pool is charged.

    Args:
        config: the engine's config (``budget``, ``tenants``, ``blocks``, ``checkpoint_records``).
        state_dir: its filesystem is what a disk percentage is a share of.
        machine: what the budgets are shares of (default: ``Machine.probe(state_dir)``).
    Raises:
        ConfigError: a budget or a reservation that does not hold on this host, naming the key.
        NoRoomForLogError: the filesystem cannot hold the log's room.

    Invariants: the ledgers'; each pool's ``TierStore`` charges what its files take.

    Thread safety: the ledgers are locked; the rest does not change after construction.
    """

    def __init__(self, config: EngineConfig, state_dir: str, machine: Machine | None = None) -> None:
        self.config = config
        machine = machine if machine is not None else Machine.probe(state_dir)
        self.machine = machine
        self.budget = Budget.resolve(config.budget, machine, config.tenants)
        on_disk = log_bytes_on_disk(state_dir)
        self.log_reserve = (max(LOG_FLOOR, 2 * on_disk + config.checkpoint_records * MEAN_RECORD_BYTES)
                            if self.budget.disk else 0)
        if self.budget.disk and self.log_reserve > self.budget.disk:
            raise ConfigError(f"engine.budget.disk ({format_bytes(self.budget.disk)}) is below the "
                              f"log's room ({format_bytes(self.log_reserve)}): raise [engine.budget] "
                              f"disk to at least {format_bytes(self.log_reserve)}")
        self.ledgers: dict[str, BudgetLedger] = {}
        for tier in TIER_NAMES:
            try:
                self.ledgers[tier] = BudgetLedger.for_tier(
                    self.budget, tier, self.log_reserve if tier == "disk" else 0)
            except ValueError as exc:
                raise ConfigError(f"[engine.budget] {tier}: {exc}; lower the tenants' "
                                  f"reserved.{tier} or raise [engine.budget] {tier}") from None
        self._check_log_room(state_dir, on_disk)
        self.log_rooms = LogRooms(self.log_reserve // 2)  # room above LOG_POOL_ROOM, all pools
        self.fixed_device: dict = {}  # (tenant, layout) -> device blocks of each open GPU pool
        self.out_of_space = False  # pool files met ENOSPC / EDQUOT lately (``watch_space``)
        self._refusals, self._full_at = 0, 0.0
        log.info("budgets device=%d host=%d disk=%d log_reserve=%d", self.budget.device,
                 self.budget.host, self.budget.disk, self.log_reserve)

    def _check_log_room(self, state_dir: str, on_disk: int) -> None:
        if not self.budget.disk:
            return
        where = os.path.abspath(state_dir)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
        need = max(0, min(self.log_reserve, filesystem_bytes(where)) - on_disk)
        if free < need:
            raise NoRoomForLogError(where, need, free)

    # -- sizes ---------------------------------------------------------------------------------

    def pool_sizes(self, layout: KVLayout) -> tuple[int, int, int]:
        """``(device, host, disk)`` blocks of a pool of ``layout``: the tier's budget less a
        header, in whole blocks, capped by ``[engine.blocks]`` (0: the tier is off for it)."""
        caps = self.config.blocks_for(layout)
        cap = (UNCAPPED,) * 3 if caps is None else caps.as_tuple()
        bb = layout.block_bytes
        header = (0 if self.device_fixed else DATA_OFFSET, DATA_OFFSET, DATA_OFFSET)  # a GPU pool has none
        return tuple(min(cap[i], max(0, (self.ledgers[t].capacity - header[i]) // bb))
                     if self.ledgers[t].capacity > 0 and cap[i] else 0
                     for i, t in enumerate(TIER_NAMES))

    # -- a device tier on a GPU ----------------------------------------------------------------

    @property
    def device_fixed(self) -> bool:
        """The device tier is GPU memory: a pool's device tier is one allocation, charged whole
        to the device ledger when the pool opens and given back when it closes
        (``prefixd.storage.pools``)."""
        return self.machine.gpu_total is not None

    def fixed_device_blocks(self, tenant: str, layout: KVLayout, want: int) -> int:
        """The device blocks a GPU pool of ``layout`` is opened with: ``want`` (its manifest's,
        within ``[engine.blocks]``), at most what ``tenant`` may be charged on the device now
        (other pools on the GPU hold theirs whole). ``want`` itself without a GPU."""
        if not self.device_fixed:
            return want
        return min(want, self.ledgers["device"].available(tenant) // layout.block_bytes)

    def opening(self, tenant: str, layout: KVLayout, sizes) -> tuple[int, int, int]:
        """The slots per tier a pool opens with: ``sizes``, the device tier on a GPU cut to
        ``fixed_device_blocks`` (and recorded in ``fixed_device`` until it closes).

        Raises:
            BudgetExceededError: a GPU pool would get no device block.
        """
        if not self.device_fixed:
            return tuple(sizes)
        device = self.fixed_device_blocks(tenant, layout, sizes[0])
        if device < 1:
            raise BudgetExceededError(
                f"the device budget on the GPU is taken whole by the pools open there: a pool "
                f"of layout {layout.model_id!r} gets no block; raise [engine.budget] device, or "
                f"cap each layout's device blocks ([engine.blocks] device)")
        self.fixed_device[(tenant, layout)] = device
        return (device, *sizes[1:])

    # -- admission -----------------------------------------------------------------------------

    def refusal(self, tenant: str, layout: KVLayout, max_model_len: int) -> str | None:
        """Why an Attach of ``tenant`` with ``layout`` must be refused, or None.

        Refused: a device tier that cannot hold one request of ``max_model_len`` tokens (or a
        single block), no host and no disk room for a block, or a tier where one such request
        (its extents and the file's header) is more than the tenant may ever hold there: its
        ``max``, and the budget less every other tenant's ``reserved``. (What others hold now
        is evicted for it: ``first_extents`` and the cross-pool LRU.)
        """
        sizes = self.pool_sizes(layout)
        bs, bb = layout.block_size, layout.block_bytes
        need = max(1, -(-max_model_len // bs)) if max_model_len else 1
        if sizes[0] < need:
            return self._too_small(layout, "device", sizes[0], need, max_model_len)
        held = self.fixed_device.get((tenant, layout))  # an open GPU pool: what it took
        if self.device_fixed and (held if held is not None else
                                  self.fixed_device_blocks(tenant, layout, sizes[0])) < need:
            ledger = self.ledgers["device"]
            return (f"the device budget (engine.budget.device = {self._written('device')}: "
                    f"{format_bytes(ledger.capacity)}) on the GPU holds "
                    f"{format_bytes(ledger.used_bytes)}, taken whole by the pools open there "
                    f"(tenant {tenant!r}: {format_bytes(ledger.used_by(tenant))}); a pool of "
                    f"layout {layout.model_id!r} needs {need} blocks "
                    f"({format_bytes(need * bb)}): raise [engine.budget] device, or cap each "
                    f"layout's device blocks ([engine.blocks.models.\"<id>\"] device)")
        if not sizes[1] and not sizes[2]:
            return self._too_small(layout, "host", 0, 1, 0)
        for i, tier in enumerate(TIER_NAMES):
            if not sizes[i]:
                continue
            ledger = self.ledgers[tier]
            nbytes = _extents(DATA_OFFSET + min(need, sizes[i]) * bb)
            room = self.room_for(tenant, i)
            if nbytes > room:
                what = (f"one request of max_model_len={max_model_len} takes "
                        f"{format_bytes(nbytes)}" if max_model_len
                        else f"its first block takes {format_bytes(nbytes)}")
                return (f"the {tier} budget (engine.budget.{tier} = {self._written(tier)}: "
                        f"{format_bytes(ledger.capacity)} for pools) holds "
                        f"{format_bytes(ledger.used_bytes)} (tenant {tenant!r}: "
                        f"{format_bytes(ledger.used_by(tenant))}, at most "
                        f"{format_bytes(room)}); a pool of layout {layout.model_id!r} does not "
                        f"fit: {what} there: raise [engine.budget] {tier} (or the tenant's "
                        f"max.{tier}, or lower other tenants' reserved.{tier})")
        return None

    def first_extents(self, layout: KVLayout) -> tuple[int, int, int]:
        """Bytes per tier a new pool of ``layout`` takes with its first block: its files'
        header and first block, in whole extents (0: the tier is off for it), and on disk its
        log's room (``LOG_POOL_ROOM``)."""
        first = [_extents(DATA_OFFSET + layout.block_bytes) if n else 0
                 for n in self.pool_sizes(layout)]
        if self.budget.disk:
            first[2] += LOG_POOL_ROOM
        return tuple(first)

    # -- the logs' room ------------------------------------------------------------------------

    def log_room(self, tenant: str, wal_file: str) -> LogRoom:
        """The room of a pool's log (``wal_file``: its ``data.mdb``), reserved: see
        ``prefixd.engine.log_room`` (none kept without a disk budget).

        Raises:
            BudgetExceededError: the disk budget cannot take ``LOG_POOL_ROOM`` (nothing charged).
            NoSpaceError: the filesystem has no room for it (nothing charged).
        """
        room = LogRoom(wal_file, tenant, self.ledgers["disk"] if self.budget.disk else None,
                       self.log_rooms)
        room.reserve()
        return room

    def room_for(self, tenant: str, tier: int) -> int:
        """The most bytes ``tenant`` may ever hold in ``tier``: its ``max``, and the tier's
        room for pools less the other tenants' ``reserved`` (its own blocks and every other
        tenant's above its reservation may be evicted for it)."""
        others = sum(t.reserved[tier] for t in self.budget.tenants if t.name != tenant)
        room = self.ledgers[TIER_NAMES[tier]].capacity - others
        for t in self.budget.tenants:
            if t.name == tenant and t.max[tier] is not None:
                room = min(room, t.max[tier])
        return max(0, room)

    def _too_small(self, layout: KVLayout, tier: str, have: int, need: int, max_model_len: int) -> str:
        i = TIER_NAMES.index(tier)
        caps = self.config.blocks_for(layout)
        cap = UNCAPPED if caps is None else caps.as_tuple()[i]
        key = (f"{self.cap_key(layout)} {tier}" if have == cap
               else f"[engine.budget] {tier} (engine.budget.{tier} = {self._written(tier)}: "
                    f"{format_bytes(self.ledgers[tier].capacity)})")
        what = (f"one request of the client's max_model_len={max_model_len} needs {need} blocks"
                if max_model_len else f"a pool needs at least {need} block")
        return (f"the {tier} tier holds {have} blocks of layout {layout.model_id!r} "
                f"({format_bytes(layout.block_bytes)} a block); {what}: raise {key} to hold "
                f"{format_bytes(pool_file_bytes(need, layout.block_bytes))}, or use a smaller "
                f"layout or max_model_len")

    def cap_key(self, layout: KVLayout) -> str:
        if any(model_id == layout.model_id for model_id, _ in self.config.model_blocks):
            return f'[engine.blocks.models."{layout.model_id}"]'
        return "[engine.blocks]"

    def _written(self, tier: str) -> str:
        size = getattr(self.config.budget, tier)
        return "the default" if size is None else repr(size.text)

    def by_tier(self) -> dict:
        """The ledgers by ``Tier``, as ``TierStore`` takes them."""
        return {Tier(i): self.ledgers[t] for i, t in enumerate(TIER_NAMES)}

    # -- a full filesystem ----------------------------------------------------------------------

    def watch_space(self, stores, now: float | None = None) -> bool:
        """Log ONE WARNING when pool files start to meet a full filesystem (ENOSPC, EDQUOT:
        another process filled it; grows are refused and retried, new blocks stay in memory,
        commits go on at ``crash``), and one INFO once none has for ``SPACE_CLEAR_S``.
        ``stores``: ``(name, TierStore)`` of every pool; the engine's tick calls this.
        Returns whether the filesystem counts as full now (``out_of_space``).

        NOTE: a pool that meets ENOSPC evicts, its extents are punched and a smaller grow may
        then succeed: the state flips many times a second, so it is judged by refusals over
        a few seconds, not by the last grow, and the log says it once per episode."""
        now = time.monotonic() if now is None else now
        refusals, full = 0, []
        for name, store in stores:
            for t in store.tiers:
                n, last_full = store.no_space(t)
                refusals += n
                if last_full:
                    full.append(f"{name}:{Tier(t).name.lower()}")
        if refusals > self._refusals or full:
            if not self.out_of_space:
                log.warning("the filesystem is full: pool files cannot grow, new blocks stay "
                            "in memory and commits go on at crash through the host tier; "
                            "grows are retried pools=%s", ",".join(full) or "-")
            self.out_of_space, self._full_at = True, now
        elif self.out_of_space and now - self._full_at >= SPACE_CLEAR_S:
            log.info("the filesystem has room again: pool files grow")
            self.out_of_space = False
        self._refusals = refusals
        return self.out_of_space

    # -- reports -------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Per tier: ``budget`` (bytes), ``used`` (bytes charged), ``by_tenant``; and
        ``log_reserve`` (disk bytes kept for the logs), ``out_of_space`` (``watch_space``)."""
        out = {}
        for tier in TIER_NAMES:
            ledger = self.ledgers[tier]
            out[tier] = {"budget": self.budget.bytes_of(tier), "used": ledger.used_bytes,
                         "by_tenant": ledger.by_tenant()}
        out["log_reserve"] = self.log_reserve
        out["out_of_space"] = self.out_of_space
        return out

    def check_invariants(self) -> None:
        for ledger in self.ledgers.values():
            ledger.check_invariants()


def gpu_total(use_cuda: bool | None) -> int | None:
    """The GPU's memory when the device tier is on it (what a ``device`` percentage is of)."""
    if use_cuda is False:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory
