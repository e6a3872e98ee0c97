"""``Engine``: several pools (tenant x layout) in one state directory behind one lock."""

import dataclasses
import inspect
import os

import pytest

from prefixd.api.layout import KVLayout
from prefixd.engine import (EngineConfig, EngineError, PoolDirError, Tenant,
                            TierSizes, UnknownTenantError)
from prefixd.engine import engine as engine_mod
from prefixd.engine.engine import Engine, cache_kwargs
from prefixd.wal import StateLockedError
from prefixd.wal.lock import StateDirLock
from tests.crash.pools_workload import PoolTokens

A = KVLayout("model-a", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=2)
B = KVLayout("org/model-b", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_size=4)
TENANTS = (Tenant("acme", "salt-a"), Tenant("globex", "salt-g"))
POOLS = [(t.name, layout) for t in TENANTS for layout in (A, B)]


@pytest.fixture
def open_engine(tmp_path):
    """``open_engine(**config) -> Engine`` on one state dir; closes what is left open."""
    made = []

    def _open(**kw):
        kw.setdefault("shm_dir", str(tmp_path / "shm"))
        kw.setdefault("tenants", TENANTS)
        kw.setdefault("blocks", TierSizes(8, 8, 64))
        engine = Engine(str(tmp_path / "state"), EngineConfig(**kw))
        made.append(engine)
        return engine

    yield _open
    for engine in made:
        engine.close()


def _serve(dc, tokens, pool: int):
    """Open, write the pool's KV bytes, commit (waiting for a ticket if it is one), release."""
    seq = dc.open(tokens)
    PoolTokens(dc.store, dc.layout.block_size, pool).write(seq.block_table, tokens, seq.cached_tokens)
    result = dc.commit(seq.id, "crash")
    if hasattr(result, "result"):
        result.result()
    dc.release(seq.id)


def _cached(dc, tokens, pool: int) -> int:
    """Tokens of ``tokens`` served from the cache, after checking their bytes are the pool's."""
    seq = dc.open(tokens)
    n = seq.cached_tokens
    PoolTokens(dc.store, dc.layout.block_size, pool).check(
        seq.block_table[: n // dc.layout.block_size], tokens[:n])
    dc.release(seq.id)
    return n


def test_four_pools_recover_their_own_blocks_after_a_restart(open_engine):
    engine = open_engine()
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    for i, (tenant, layout) in enumerate(POOLS):
        dc = engine.pool(tenant, layout)
        _serve(dc, shared, i)  # the same prompt in every pool, with that pool's bytes
        _serve(dc, [100 + i] * 9, i)  # a prompt of this pool alone
    engine.check_invariants()
    engine.close()

    engine = open_engine()
    engine.check_invariants()
    assert [(p.tenant, p.layout.model_id) for p in engine.pools()] == [
        ("acme", "model-a"), ("acme", "org/model-b"), ("globex", "model-a"), ("globex", "org/model-b")]
    for i, (tenant, layout) in enumerate(POOLS):
        dc = engine.pool(tenant, layout)
        dc.expire_recovered()
        bs = layout.block_size
        assert _cached(dc, shared, i) == 8
        assert _cached(dc, [100 + i] * 9, i) == 8
        for j in range(len(POOLS)):
            if j != i:
                assert dc.lookup([100 + j] * 9).cached_tokens == 0, f"pool {i} hits pool {j}'s prompt"
        info = next(p for p in engine.pools() if (p.tenant, p.layout) == (tenant, layout))
        assert info.capacity == (8, 8, 64)
        assert sum(info.num_blocks[1:]) >= 2 * 8 // bs  # both prompts' blocks are in a lower tier


def test_a_second_engine_on_the_same_state_dir_is_refused_naming_the_first_pid(open_engine, tmp_path):
    engine = open_engine()
    engine.pool("acme", A)
    with pytest.raises(StateLockedError) as err:
        Engine(str(tmp_path / "state"), engine.config)
    assert err.value.pid == os.getpid() and str(os.getpid()) in str(err.value)
    engine.close()
    open_engine().close()  # the lock is released by close


def test_an_unknown_tenant_is_refused_naming_the_configured_ones(open_engine):
    engine = open_engine()
    with pytest.raises(UnknownTenantError, match="'initech'.*'acme', 'globex'.*engine.tenants"):
        engine.pool("initech", A)
    assert not os.path.exists(engine.pool_path("initech", A))


def test_no_two_pools_share_a_shm_file_name(open_engine):
    """Two pools of one layout (two tenants) must not map each other's host pool file."""
    engine = open_engine()
    names = {engine.pool(t, layout).store.name for t, layout in POOLS}
    assert len(names) == len(POOLS)
    engine.check_invariants()


def test_each_pool_gets_its_configured_sizes_and_settings(open_engine):
    engine = open_engine(model_blocks=(("org/model-b", TierSizes(4, 0, 32)),), sync="none",
                         checkpoint_records=77, spill_blocks=3)
    a, b = engine.pool("acme", A), engine.pool("acme", B)
    assert [p.capacity for p in engine.pools()] == [(8, 8, 64), (4, 0, 32)]
    assert a.wal.sync == b.wal.sync == "none"
    assert (a.checkpoint_records, a.spill_blocks) == (77, 3)
    assert a.cache.tree.root_hash != engine.pool("globex", A).cache.tree.root_hash


def test_tick_and_checkpoint_reach_every_pool(open_engine):
    engine = open_engine()
    for i, (tenant, layout) in enumerate(POOLS):
        _serve(engine.pool(tenant, layout), [1, 2, 3, 4, 5], i)
    engine.tick()
    lsns = engine.checkpoint()
    assert set(lsns) == set(POOLS)
    assert all(lsn > 0 for lsn in lsns.values())


def test_a_closed_engine_refuses_work(open_engine):
    engine = open_engine()
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        engine.pool("acme", A)


def test_a_pool_without_its_manifest_is_refused_and_the_open_leaves_nothing_held(open_engine, tmp_path):
    """A pool directory whose manifest is gone cannot be named; the engine must not guess, and
    a failed open must release the lock and the pools it had opened."""
    engine = open_engine()
    for tenant, layout in POOLS:
        engine.pool(tenant, layout)
    path = engine.pool_path("globex", B)
    engine.close()
    os.rename(os.path.join(path, "pool.json"), os.path.join(tmp_path, "pool.json"))
    with pytest.raises(PoolDirError, match="no pool.json.*restore"):
        open_engine()
    StateDirLock(str(tmp_path / "state")).release()  # the lock was released
    os.rename(os.path.join(tmp_path, "pool.json"), os.path.join(path, "pool.json"))
    assert len(open_engine().pools()) == 4  # the pools opened before the failure were closed


def test_a_damaged_or_moved_manifest_is_refused(open_engine):
    engine = open_engine()
    engine.pool("acme", A)
    path = engine.pool_path("acme", A)
    engine.close()
    manifest = os.path.join(path, "pool.json")
    good = open(manifest, "rb").read()
    open(manifest, "wb").write(b"{not json")
    with pytest.raises(PoolDirError, match="cannot be read"):
        open_engine()
    open(manifest, "wb").write(good)
    moved = os.path.join(os.path.dirname(os.path.dirname(path)), "globex", os.path.basename(path))
    os.makedirs(os.path.dirname(moved))
    os.rename(path, moved)
    with pytest.raises(PoolDirError, match="names tenant 'acme'.*move it back"):
        open_engine()


def test_a_changed_tenant_salt_is_refused(open_engine):
    engine = open_engine()
    engine.pool("acme", A)
    engine.close()
    with pytest.raises(PoolDirError, match="different salt.*restore the old salt"):
        open_engine(tenants=(Tenant("acme", "new-salt"), TENANTS[1]))


def test_a_pool_creation_that_never_wrote_its_manifest_is_cleaned_up(open_engine):
    engine = open_engine()
    path = engine.pool_path("acme", B)
    engine.close()
    os.makedirs(path)
    open(os.path.join(path, "pool.json.tmp"), "wb").write(b"{")
    engine = open_engine()
    assert engine.pools() == [] and not os.path.exists(path)


def test_pools_of_a_tenant_no_longer_configured_stay_on_disk_unopened(open_engine):
    engine = open_engine()
    _serve(engine.pool("globex", A), [1, 2, 3, 4, 5], 2)
    engine.close()
    engine = open_engine(tenants=TENANTS[:1])
    assert engine.pools() == [] and engine.unconfigured == [os.path.dirname(engine.pool_path("globex", A))]
    engine.close()
    engine = open_engine()
    dc = engine.pool("globex", A)
    dc.expire_recovered()
    assert _cached(dc, [1, 2, 3, 4, 5], 2) == 4



def test_every_setting_reaches_the_durable_cache_keywords():
    config = EngineConfig(sync="interval", sync_interval_ms=50, forget_missing_tier=True,
                          eviction="lfu", verify="eager", reclaim_grace_s=1.5, use_cuda=None,
                          write_policy="write_back")
    tenant = Tenant("acme", "s")
    assert cache_kwargs(config, tenant) == dict(
        tenant_salt=b"s", sync="interval", sync_interval_ms=50, write_policy="write_back",
        policy="lfu", verify="eager", shm_dir="/dev/shm", reclaim_grace_s=1.5,
        checkpoint_records=100_000, spill_blocks=256, use_cuda=None, forget_missing_tier=True)
    with_blocks = dataclasses.replace(config, checkpoint_blocks=10)
    assert cache_kwargs(with_blocks, tenant)["checkpoint_blocks"] == 10
    # and every keyword is one DurableCache takes
    accepted = inspect.signature(engine_mod.DurableCache).parameters
    assert set(cache_kwargs(with_blocks, tenant)) <= set(accepted)
