"""The engine's byte budgets (``prefixd.engine.budgets``) on real pools: pools charged in one
ledger per tier, each pool's log room kept and charged, and a budget changed between two starts
that keeps every pool and its blocks."""

import os

from prefixd.api.layout import KVLayout
from prefixd.config import EngineConfig, Tenant
from prefixd.config.budget_settings import BudgetSpec
from prefixd.engine import Engine
from prefixd.engine.budgets import LOG_POOL_ROOM

MiB = 1 << 20
LAYOUT = KVLayout("budgets", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)
OTHER = KVLayout("budgets-2", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def config(shm: str, host: str = "32MiB") -> EngineConfig:
    return EngineConfig(budget=BudgetSpec(device="16MiB", host=host, disk="128MiB"), shm_dir=shm,
                        tenants=(Tenant("a", b"a"), Tenant("b", b"b")))


def store(dc, first: int) -> None:
    seq = dc.open(list(range(first, first + 41)))
    dc.commit(seq.id).result()
    dc.release(seq.id)


def test_pools_of_every_tenant_are_charged_in_one_ledger_per_tier_with_their_logs_room(tmp_path):
    with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
        a, b = engine.pool("a", LAYOUT), engine.pool("b", OTHER)
        store(a, 0)
        store(b, 100)
        disk = engine.budgets.ledgers["disk"]
        for tenant, dc in (("a", a), ("b", b)):
            wal = os.path.join(dc.state_dir, "wal", "data.mdb")
            assert os.stat(wal).st_blocks * 512 >= LOG_POOL_ROOM  # its room, allocated
            assert disk.used_by(tenant) >= LOG_POOL_ROOM + dc.store.held_bytes(2)
            for tier in range(2):
                ledger = engine.budgets.ledgers[("device", "host")[tier]]
                assert ledger.used_by(tenant) == dc.store.held_bytes(tier) > 0
        engine.check_invariants()
    # closed: every byte given back
    assert all(ledger.used_bytes == 0 for ledger in engine.budgets.ledgers.values())


def test_a_budget_changed_between_two_starts_keeps_every_pool_and_its_blocks(tmp_path):
    """A pool keeps the slots its manifest says: a larger (or smaller) budget at the next start
    must not make its files disagree with their headers (the start was refused)."""
    state, shm = str(tmp_path / "state"), str(tmp_path / "shm")
    with Engine(state, config(shm, "32MiB")) as engine:
        store(engine.pool("a", LAYOUT), 0)
        engine.checkpoint()
        capacity = engine.pools()[0].capacity
    for host in ("64MiB", "8MiB"):
        with Engine(state, config(shm, host)) as engine:
            (info,) = engine.pools()
            assert info.capacity == capacity and sum(info.num_blocks) > 0
            dc = engine.pool("a", LAYOUT)
            assert dc.lookup(list(range(41))).cached_tokens == 40
            engine.check_invariants()


class _Store:
    """A TierStore as ``watch_space`` sees it: refusals so far and whether the last grow was."""

    tiers = (0, 1, 2)

    def __init__(self):
        self.refusals, self.full = 0, False

    def no_space(self, tier):
        return (self.refusals, self.full) if tier == 2 else (0, False)


def test_a_full_filesystem_is_said_once_per_episode_and_cleared_after_quiet_seconds(tmp_path, caplog):
    from prefixd.engine.budgets import SPACE_CLEAR_S, Budgets

    budgets = Budgets(config(str(tmp_path / "shm")), str(tmp_path))
    store = _Store()
    with caplog.at_level("INFO", logger="prefixd.engine.budgets"):
        assert not budgets.watch_space([("p", store)], now=0.0)
        for t in range(10):  # refusals and successful grows flip many times a second
            store.refusals += 1
            store.full = t % 2 == 0
            assert budgets.watch_space([("p", store)], now=1.0 + t / 10)
        assert budgets.watch_space([("p", store)], now=2.0 + SPACE_CLEAR_S - 0.5)  # quiet, not long
        assert not budgets.watch_space([("p", store)], now=2.0 + SPACE_CLEAR_S)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    infos = [r for r in caplog.records if "room again" in r.getMessage()]
    assert len(warnings) == 1 and "filesystem is full" in warnings[0].getMessage()
    assert len(infos) == 1
    assert budgets.snapshot()["out_of_space"] is False


def test_a_gpu_pool_takes_its_device_tier_whole_from_the_device_budget(tmp_path):
    """With the device tier on a GPU (``Machine.gpu_total``), a pool opens with what its
    tenant may take of the device budget now, charged whole (``TensorPool``, tested on the
    CPU in ``tests/storage/test_pools.py``); once the budget is taken, a new layout's Attach is
    refused naming ``[engine.budget] device`` and its open is refused; the open pool's own
    Attach is not; a closed pool's blocks are free again. No GPU here: ledger and sizing only."""
    from prefixd.config.budget_settings import Machine
    from prefixd.engine.budgets import Budgets
    from prefixd.storage.errors import BudgetExceededError
    import pytest

    cfg = EngineConfig(budget=BudgetSpec(device="16MiB", host="32MiB", disk="128MiB"),
                       shm_dir=str(tmp_path / "shm"), tenants=(Tenant("a", b"a"), Tenant("b", b"b")))
    budgets = Budgets(cfg, str(tmp_path), Machine(64 << 30, 1 << 40, gpu_total=80 << 30))
    assert budgets.device_fixed
    device = budgets.ledgers["device"]
    sizes = budgets.opening("a", LAYOUT, budgets.pool_sizes(LAYOUT))
    assert sizes[0] == budgets.pool_sizes(LAYOUT)[0] == budgets.fixed_device[("a", LAYOUT)]
    device.charge("a", sizes[0] * LAYOUT.block_bytes)  # what the pool's TensorPool charges
    assert budgets.refusal("a", LAYOUT, 64) is None  # its own pool is open
    why = budgets.refusal("b", OTHER, 64)
    assert why is not None and "[engine.budget] device" in why and "taken whole" in why, why
    with pytest.raises(BudgetExceededError, match=r"\[engine.budget\] device"):
        budgets.opening("b", OTHER, budgets.pool_sizes(OTHER))
    device.release("a", sizes[0] * LAYOUT.block_bytes)  # the pool closed
    del budgets.fixed_device[("a", LAYOUT)]
    assert budgets.refusal("b", OTHER, 64) is None
    half = budgets.opening("b", OTHER, (budgets.pool_sizes(OTHER)[0] // 2, 1, 1))[0]
    device.charge("b", half * OTHER.block_bytes)
    rest = budgets.opening("a", LAYOUT, budgets.pool_sizes(LAYOUT))[0]
    assert rest == device.available("a") // LAYOUT.block_bytes < sizes[0]  # what is left
