"""Admission at Attach: a pool too small for one request of the client's max_model_len, a
block above ``max_block_bytes`` and a new pool that does not fit its tenant's budget are
refused loudly, naming the key; an unknown length gets one WARNING per pool below the floor."""

import logging

import grpc
import pytest

import prefixd.client as pc
from prefixd.daemon import admission
from prefixd.config import EngineConfig, TierSizes
from prefixd.config.budget_settings import BudgetSpec, Machine
from prefixd.engine.budgets import Budgets
from prefixd.api.layout import KVLayout
from prefixd.daemon.status import RpcFailure
from tests.daemon.harness import start_daemon

LAYOUT = KVLayout("adm", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
SMALL = """
[engine]
shm_dir = "{shm}"

[engine.blocks]
device = 8
host = 8
disk = 0

[daemon]
lease_s = {lease_s}
"""


GiB = 1 << 30
MACHINE = Machine(mem_total=16 * GiB, disk_total=256 * GiB)


def config(device, models=()):
    cfg = EngineConfig(blocks=TierSizes(device=device, host=16, disk=0), model_blocks=models)
    return Budgets(cfg, "/nonexistent-state-dir", machine=MACHINE)


def test_a_request_that_fits_is_admitted_and_one_that_does_not_is_refused_naming_the_key():
    admission.check_attach(config(16), "t", LAYOUT, 64)  # 16 blocks of 4: exactly one request
    with pytest.raises(RpcFailure) as err:
        admission.check_attach(config(16), "t", LAYOUT, 65)
    msg = str(err.value)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "holds 16 blocks" in msg and "needs 17 blocks" in msg
    assert "[engine.blocks] device" in msg


def test_a_model_override_is_the_key_named():
    cfg = config(1024, models=(("adm", TierSizes(device=2, host=4, disk=0)),))
    with pytest.raises(RpcFailure, match=r'\[engine.blocks.models."adm"\] device'):
        admission.check_attach(cfg, "t", LAYOUT, 100)


def test_unknown_length_warns_once_per_pool_below_the_floor(caplog):
    layout = KVLayout("adm-warn", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    with caplog.at_level(logging.WARNING, logger="prefixd.daemon.admission"):
        for _ in range(3):
            admission.check_attach(config(2), "t1", layout, 0)
        admission.check_attach(config(2), "t2", layout, 0)  # another tenant: another pool
        admission.check_attach(config(admission.FLOOR_TOKENS // 4), "t3", layout, 0)  # at the floor
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert all("[engine.blocks] device" in line and "device_blocks=2" in line for line in lines)


def test_attach_with_max_model_len_is_refused_by_a_real_daemon():
    """End to end: the field travels in AttachRequest and the client raises ResourceExhausted."""
    with start_daemon(SMALL) as d:
        with pytest.raises(pc.ResourceExhausted, match="max_model_len=64 needs 16 blocks.*"
                                                       r"\[engine.blocks\] device"):
            pc.connect(d.socket, LAYOUT, max_model_len=64, mapped=False)
        with pc.connect(d.socket, LAYOUT, max_model_len=32, mapped=False) as s:
            assert s.lookup(list(range(8))) == 0
        with pc.connect(d.socket, LAYOUT, mapped=False):
            pass
        assert d.log_text().count("pool too small to be useful") == 1


def test_a_device_budget_below_one_request_names_the_budget_key():
    cfg = EngineConfig(budget=BudgetSpec(device="64KiB"), blocks=TierSizes(device=1024, host=16, disk=0))
    budgets = Budgets(cfg, "/nonexistent-state-dir", machine=MACHINE)
    # 256-byte blocks: (64 KiB - a 4 KiB header) / 256 = 240 device blocks of 4 tokens
    assert budgets.pool_sizes(LAYOUT)[0] == 240
    with pytest.raises(RpcFailure, match=r"\[engine.budget\] device \(engine.budget.device = '64KiB'"):
        admission.check_attach(budgets, "t", LAYOUT, 4 * 241)


def test_a_block_above_max_block_bytes_is_refused_naming_the_limit():
    with pytest.raises(RpcFailure, match=r"\[daemon.limits\] max_block_bytes = 64"):
        admission.check_attach(config(16), "t", LAYOUT, 0, max_block_bytes=64)
    admission.check_attach(config(16), "t", LAYOUT, 0, max_block_bytes=LAYOUT.block_bytes)


def test_what_other_pools_hold_now_does_not_refuse_an_attach():
    """Their blocks are evicted for it (the cross-pool LRU), so only what the tenant may ever
    hold counts; its first block's extents are what ``first_extents`` makes room for."""
    cfg = EngineConfig(budget=BudgetSpec(host="8MiB"), blocks=TierSizes(device=16, host=4096, disk=0))
    budgets = Budgets(cfg, "/nonexistent-state-dir", machine=MACHINE)
    budgets.ledgers["host"].charge("other", 8 << 20)  # every byte held by pools of another tenant
    admission.check_attach(budgets, "t", LAYOUT, 0)
    assert budgets.first_extents(LAYOUT) == (2 << 20, 2 << 20, 4 << 20)  # disk: + the log's room


def test_a_request_larger_than_what_the_tenant_may_ever_hold_is_refused():
    """Tenant a may hold at most its max; b at most the budget less a's reservation."""
    from prefixd.config import Tenant

    tenants = (Tenant("a", b"a", max={"host": "4MiB"}, reserved={"host": "2MiB"}), Tenant("b", b"b"))
    cfg = EngineConfig(budget=BudgetSpec(host="8MiB"), blocks=TierSizes(device=1 << 20, host=1 << 20, disk=0),
                       tenants=tenants)
    budgets = Budgets(cfg, "/nonexistent-state-dir", machine=MACHINE)
    assert budgets.room_for("a", 1) == 4 << 20 and budgets.room_for("b", 1) == 6 << 20
    tokens_per_mib = (1 << 20) // LAYOUT.block_bytes * LAYOUT.block_size
    admission.check_attach(budgets, "a", LAYOUT, 3 * tokens_per_mib)
    with pytest.raises(RpcFailure, match="tenant's max.host"):
        admission.check_attach(budgets, "a", LAYOUT, 5 * tokens_per_mib)
    admission.check_attach(budgets, "b", LAYOUT, 5 * tokens_per_mib)
    with pytest.raises(RpcFailure, match="at most 6.0 MiB"):
        admission.check_attach(budgets, "b", LAYOUT, 7 * tokens_per_mib)
