"""The cluster tier's engine side without a Redis: write policies, the bounded write-behind
queue, failures as misses, counters, config. A dict stands in for the cluster (``FakeStore``)."""

import dataclasses
import pathlib
import subprocess
import sys
import threading
import time
import types

import pytest

from prefixd.api.tiers import Tier
from prefixd.cache.errors import OutOfBlocks
from prefixd.config.cluster_settings import ClusterConfig
from prefixd.config.errors import ConfigError
from prefixd.config.toml_reader import engine_config, read_engine_config
from prefixd.config.toml_writer import engine_toml
from prefixd.engine import EngineConfig, TierSizes
from prefixd.engine import cluster_tier
from tests.cluster.hosts import BS, LAYOUT, config, host, kv_of, prompt, serve, served


class FakeStore:
    """``ClusterStore``'s interface over a dict; ``gate`` (an Event) holds every ``put``."""

    def __init__(self, values=None) -> None:
        self.values = {} if values is None else values
        self.puts: list[int] = []
        self.gate: threading.Event | None = None
        self.fail_get = self.fail_put = False
        self.closed = False

    def put(self, blocks) -> int:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_put:
            raise ConnectionError("cluster gone")
        self.puts.append(len(blocks))
        for b in blocks:
            self.values[b.block_hash] = b
        return len(blocks)

    def get_run(self, hashes, token_ids):
        if self.fail_get:
            raise ConnectionError("cluster gone")
        run = []
        for h, toks in zip(hashes, token_ids):
            b = self.values.get(h)
            if b is None or b.token_ids != toks:
                break
            run.append(b)
        return run

    def stats(self) -> dict:
        return {"written": sum(self.puts)}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    """Every ``ClusterTier`` made in the test talks to one shared ``FakeStore``."""
    store = FakeStore()
    monkeypatch.setattr(cluster_tier, "connect", lambda config, namespace: store)
    return store


def _pool(tmp_path, name="a", **cluster):
    engine = host(tmp_path, name, config(tmp_path, ["127.0.0.1:1"], **cluster))
    return engine, engine.pool("acme", LAYOUT)


def test_policy_all_writes_each_committed_block_with_its_chain_and_bytes(tmp_path, fake):
    engine, dc = _pool(tmp_path)
    try:
        tokens = prompt(1)
        serve(dc, tokens)
        assert dc.cluster.drain()
        packed = b"".join(t.to_bytes(4, "little") for t in tokens)
        fleet = dc.cluster.fleet_hashes(packed, b"", 10)
        assert sorted(fake.values) == sorted(fleet)
        for i, h in enumerate(fleet):
            block = fake.values[h]
            assert block.parent_hash == (fleet[i - 1] if i else dc.cluster.root)
            assert block.token_ids == packed[i * 4 * BS:(i + 1) * 4 * BS]
            assert block.kv == kv_of(tokens, i).tobytes()
        dc.check_invariants()
    finally:
        engine.close()


def test_fleet_names_do_not_depend_on_the_state_directory(tmp_path, fake):
    """Local hashes come from each directory's random root seed; the cluster's must not."""
    first, a = _pool(tmp_path, "a")
    second, b = _pool(tmp_path, "b")
    try:
        packed = b"".join(t.to_bytes(4, "little") for t in prompt(2))
        assert a.cache.tree.root_hash != b.cache.tree.root_hash
        assert a.cluster.fleet_hashes(packed, b"", 10) == b.cluster.fleet_hashes(packed, b"", 10)
        assert a.cluster.fleet_hashes(packed, b"x", 10) != a.cluster.fleet_hashes(packed, b"", 10)
    finally:
        first.close()
        second.close()


def test_policy_power_writes_only_blocks_of_power_commits(tmp_path, fake):
    engine, dc = _pool(tmp_path, write_policy="power")
    try:
        serve(dc, prompt(3), durability="crash")
        assert dc.cluster.drain() and not fake.values
        serve(dc, prompt(4), durability="power")
        assert dc.cluster.drain() and len(fake.values) == 10
        dc.check_invariants()
    finally:
        engine.close()


def test_policy_hits_writes_a_run_once_it_was_hit_n_times(tmp_path, fake):
    engine, dc = _pool(tmp_path, write_policy="hits>=2")
    try:
        tokens = prompt(5)
        serve(dc, tokens)
        assert served(dc, tokens) == (10 * BS, 0)  # first hit
        assert dc.cluster.drain() and not fake.values
        assert served(dc, tokens) == (10 * BS, 0)  # second hit: written
        assert dc.cluster.drain() and len(fake.values) == 10
        served(dc, tokens)  # a third hit writes nothing again
        assert dc.cluster.drain() and fake.puts == [10]
        dc.check_invariants()
    finally:
        engine.close()


def test_promoted_blocks_are_not_counted_as_requests_or_hits_twice(tmp_path, fake):
    """A promotion opens and commits a helper sequence: before its counters were taken back
    out, every remote hit counted two opens and the local match's runs got two hits."""
    first, a = _pool(tmp_path, "a")
    second, b = _pool(tmp_path, "b")
    try:
        tokens = prompt(6)
        serve(b, tokens[:3 * BS + 1])  # b has the first 3 blocks itself (one open)
        serve(a, tokens)
        assert a.cluster.drain()
        before = b.cache.stats.as_dict()
        assert served(b, tokens) == (10 * BS, 0)
        after = b.cache.stats.as_dict()
        assert after["opens"] - before["opens"] == 1
        assert after["requested_tokens"] - before["requested_tokens"] == len(tokens)
        assert after["hit_tokens"] - before["hit_tokens"] == 10 * BS
        assert after["committed_blocks"] == before["committed_blocks"]
        root = b.cache.tree.roots[b""]
        first_run = next(iter(root.children.values()))
        assert first_run.hit_count == 1  # the one open that hit it
        assert b.cluster.stats()["remote_hit_blocks"] == 7
        b.check_invariants()
    finally:
        first.close()
        second.close()


def test_a_full_queue_drops_and_counts_and_never_blocks_the_engine(tmp_path, fake):
    fake.gate = threading.Event()  # the cluster answers nothing until set
    engine, dc = _pool(tmp_path, queue_mib=3 * LAYOUT.block_bytes / (1 << 20), batch_blocks=2)
    try:
        for seed in range(10, 16):
            serve(dc, prompt(seed, 2))  # every commit returns while the writer is stuck
        stats = dc.cluster.stats()
        assert stats["dropped_blocks"] >= 12 - 2 - 3  # one batch in put, 3 blocks queued
        assert stats["offered_blocks"] == 12
        fake.gate.set()
        assert dc.cluster.drain()
        stats = dc.cluster.stats()
        assert stats["written_blocks"] + stats["dropped_blocks"] == 12
        assert len(fake.values) == stats["written_blocks"]
        dc.check_invariants()
    finally:
        fake.gate.set()
        engine.close()


def test_a_failing_cluster_is_a_miss_and_a_counter_never_an_error(tmp_path, fake):
    first, a = _pool(tmp_path, "a")
    second, b = _pool(tmp_path, "b")
    try:
        tokens = prompt(7)
        serve(a, tokens)
        assert a.cluster.drain()
        fake.fail_get = fake.fail_put = True
        assert served(b, tokens) == (0, 0)
        assert b.cluster.stats()["fetch_errors"] == 1
        serve(b, prompt(8))
        assert b.cluster.drain()
        assert b.cluster.stats()["write_errors"] == 1
        b.check_invariants()
        fake.fail_get = False  # it comes back: hits again
        assert served(b, tokens) == (10 * BS, 0)
    finally:
        first.close()
        second.close()


def test_a_block_unlike_the_one_asked_for_is_never_indexed(tmp_path, fake):
    """The engine checks what the store returns too (hash, tokens, size) before indexing."""
    first, a = _pool(tmp_path, "a")
    second, b = _pool(tmp_path, "b")
    try:
        tokens = prompt(9)
        serve(a, tokens)
        assert a.cluster.drain()
        packed = b"".join(t.to_bytes(4, "little") for t in tokens)
        h = a.cluster.fleet_hashes(packed, b"", 10)[4]
        good = fake.values[h]
        fake.values[h] = type(good)(good.block_hash, good.parent_hash, good.token_ids, good.kv[:-2])
        assert served(b, tokens) == (4 * BS, 0)
        assert b.cluster.stats()["bad_blocks"] == 1
        b.check_invariants()
    finally:
        first.close()
        second.close()


def test_promoted_blocks_are_written_down_by_the_next_tick_and_survive_a_restart(tmp_path, fake):
    """A promotion is indexed at the device alone and written down by the next ``tick`` (the
    daemon's loop), not inside the ``open``: the write-through there was most of a promotion's
    time (issue 15: remote.fetch_gbps 0.2 of the MGET floor). Written down, it survives a
    restart without the cluster."""
    cfg = config(tmp_path, ["127.0.0.1:1"])
    a = host(tmp_path, "a", cfg)
    try:
        tokens = prompt(11)
        serve(a.pool("acme", LAYOUT), tokens)
        assert a.pool("acme", LAYOUT).cluster.drain()
    finally:
        a.close()
    b = host(tmp_path, "b", cfg)
    try:
        pb = b.pool("acme", LAYOUT)
        assert served(pb, tokens) == (10 * BS, 0)
        assert pb.cache.tree.num_blocks_in[Tier.HOST] == 0  # not inside the open
        b.tick()
        assert pb.cache.tree.num_blocks_in[Tier.HOST] == 10  # written through like a commit
        b.check_invariants()
    finally:
        b.close()
    fake.values.clear()  # the cluster lost everything: the blocks are b's own
    b = host(tmp_path, "b", cfg)
    try:
        pb = b.pool("acme", LAYOUT)
        assert served(pb, tokens) == (10 * BS, 0)
        assert pb.cluster.stats()["fetches"] == 0
        b.check_invariants()
    finally:
        b.close()


def test_no_cluster_configured_imports_no_redis_and_starts_no_thread(tmp_path):
    code = f"""
import sys, threading
from prefixd.engine import Engine, EngineConfig, TierSizes
from tests.cluster.hosts import LAYOUT, prompt, serve
engine = Engine({str(tmp_path / 'state')!r}, EngineConfig(blocks=TierSizes(64, 128, 512),
                shm_dir={str(tmp_path / 'shm')!r}))
dc = engine.pool("default", LAYOUT)
serve(dc, prompt(1))
assert dc.cluster is None
assert "redis" not in sys.modules, "redis imported"
assert "prefixd.engine.cluster_tier" not in sys.modules
assert not [t for t in threading.enumerate() if "cluster" in t.name]
engine.close()
print("ok")
"""
    root = pathlib.Path(__file__).resolve().parents[2]  # ``tests`` importable from the child
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("table, says", [
    ({}, "has no nodes"),
    ({"nodes": []}, "non-empty list"),
    ({"nodes": ["localhost"]}, "is not \"host:port\""),
    ({"nodes": ["a:1"], "write_policy": "hits>=0"}, "write_policy"),
    ({"nodes": ["a:1"], "write_policy": "some"}, "write_policy"),
    ({"nodes": ["a:1"], "timeout_ms": 0}, "timeout_ms"),
    ({"nodes": ["a:1"], "batch_blocks": 1.5}, "batch_blocks"),
    ({"nodes": ["a:1"], "queue": 1}, "unknown key 'queue' in [engine.cluster]"),
])
def test_a_bad_cluster_table_is_refused_saying_what_to_change(table, says):
    with pytest.raises(ConfigError, match=None) as info:
        engine_config({"cluster": table})
    assert says in str(info.value)


def test_the_cluster_table_round_trips_through_toml():
    cfg = EngineConfig(cluster=ClusterConfig(nodes=("10.0.0.1:7000", "[::1]:7001"),
                                             write_policy="hits>=3", queue_mib=64))
    assert read_engine_config(engine_toml(cfg).encode()) == cfg
    assert cfg.cluster.min_hits == 3
    assert EngineConfig().cluster is None


def test_every_committed_block_is_offered_even_when_the_commit_forces_a_reclaim(tmp_path, fake):
    """Blocks to offer were found among the cache's pending BlocksStored events; a commit whose
    write-through ran short of quarantined host slots logs (drains) them inside the commit
    (``Upkeep.force_release``), and its blocks were never written to the cluster."""
    cfg = config(tmp_path, ["127.0.0.1:1"])
    engine = host(tmp_path, "a", dataclasses.replace(cfg, blocks=TierSizes(64, 24, 512)))
    try:
        dc = engine.pool("acme", LAYOUT)
        for seed in range(20, 40):
            serve(dc, prompt(seed))
        assert dc.forced_releases > 0  # the case this is about did happen
        assert dc.cluster.drain()
        assert dc.cluster.stats()["offered_blocks"] == 200
        assert len(fake.values) == 200
        dc.check_invariants()
    finally:
        engine.close()


def test_the_daemons_stats_and_metrics_show_the_cluster_counters(tmp_path, fake):
    from prefixd.daemon.metrics import snapshot, stats_document, stats_values
    from prefixd.engine.progress import RecoveryProgress

    cfg = config(tmp_path, ["127.0.0.1:1"])
    first, second = host(tmp_path, "a", cfg), host(tmp_path, "b", cfg)
    try:
        tokens = prompt(12)
        serve(first.pool("acme", LAYOUT), tokens)
        assert first.pool("acme", LAYOUT).cluster.drain()
        served(second.pool("acme", LAYOUT), tokens)
        core = types.SimpleNamespace(
            state="serving", started=time.monotonic(), progress=RecoveryProgress(),
            engine=second, engine_config=cfg, sessions=[], calls={}, errors={}, in_flight=0,
            rpc_times=types.SimpleNamespace(samples=lambda: []))
        values = stats_values(snapshot(core), "acme")
        assert values["prefixd_cluster_remote_hit_blocks_total"] == 10
        assert values["prefixd_cluster_remote_hit_tokens_total"] == 10 * BS
        assert values["prefixd_cluster_fetch_errors_total"] == 0
        doc = stats_document(core, "acme")
        assert doc["pools"][LAYOUT.model_id]["cluster"]["remote_hit_blocks"] == 10
        assert "prefixd_cluster_fetches_total" not in stats_values(snapshot(core), "globex")
    finally:
        first.close()
        second.close()


def test_a_fork_offers_the_blocks_it_indexed(tmp_path, fake):
    engine, dc = _pool(tmp_path)
    try:
        tokens = prompt(13)
        seq = dc.open(tokens)
        rows = dc.store.pool(Tier.DEVICE).raw.numpy()
        for i in range(10):
            rows[seq.block_table[i]] = kv_of(tokens, i)
        children = dc.fork(seq.id, 2)
        assert dc.cluster.drain() and len(fake.values) == 10
        for s in [seq, *children]:
            dc.release(s.id)
        dc.check_invariants()
    finally:
        engine.close()


def test_a_promotion_without_device_room_changes_nothing(tmp_path, fake):
    """The helper sequence is refused like any open (nothing allocated, nothing counted); the
    client's own open then gets the same answer it would get without a cluster."""
    first, a = _pool(tmp_path, "a")
    second, b = _pool(tmp_path, "b")
    try:
        tokens = prompt(14)
        serve(a, tokens)
        assert a.cluster.drain()
        held = [b.open(prompt(100 + i, 14)) for i in range(4)]  # 60 of 64 device blocks pinned
        free, opens = b.cache.allocators[Tier.DEVICE].num_free, b.cache.stats.opens
        with pytest.raises(OutOfBlocks):
            b.open(tokens)
        assert b.cluster.stats()["promote_refused"] == 1
        assert b.cache.allocators[Tier.DEVICE].num_free == free
        assert b.cache.stats.opens == opens
        b.check_invariants()
        for seq in held:
            b.release(seq.id)
        assert served(b, tokens) == (10 * BS, 0)  # room again: promoted
    finally:
        first.close()
        second.close()
