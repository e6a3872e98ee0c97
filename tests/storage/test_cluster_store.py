"""ClusterStore against a real 3-master Redis Cluster: runs, checks on read, namespaces, failures.

Every test builds its own chain of blocks (fresh hashes), so tests share the module's cluster
without seeing each other's keys. Tests that kill, pause or reconfigure nodes put them back.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time

import pytest
import xxhash
from redis.cluster import ClusterNode, RedisCluster as BareClient

from prefixd.storage.cluster import STAT_NAMES, ClusterBlock, ClusterStore
from prefixd.storage.cluster_value import encode
from tests.cluster.redis_fixture import redis_cluster  # noqa: F401  (the fixture, used by name)

NS = b"tenant-a/test-layout"
KV_BYTES = 4096
_chains = itertools.count()


def chain(n: int, *, salt: bytes = b"") -> list[ClusterBlock]:
    """``n`` consecutive blocks of a fresh prefix with deterministic, distinct bytes."""
    base = next(_chains)
    blocks, parent = [], b"\0" * 16
    for i in range(n):
        tokens = b"".join((base * 1000 + i * 16 + t).to_bytes(4, "little") for t in range(16))
        block_hash = xxhash.xxh3_128_digest(salt + parent + tokens)
        kv = xxhash.xxh3_128_digest(block_hash) * (KV_BYTES // 16)
        blocks.append(ClusterBlock(block_hash, parent, tokens, kv))
        parent = block_hash
    return blocks


def put_until_written(store: ClusterStore, blocks: list[ClusterBlock], tries: int = 50) -> int:
    """Offer ``blocks`` until all are written (a store back from an outage waits retry_after_s)."""
    written = 0
    for _ in range(tries):
        written = store.put(blocks)
        if written == len(blocks):
            break
        time.sleep(0.05)
    return written


def ask(store: ClusterStore, blocks: list[ClusterBlock]) -> list[ClusterBlock]:
    return store.get_run([b.block_hash for b in blocks], [b.token_ids for b in blocks])


@pytest.fixture
def store(redis_cluster):  # noqa: F811
    """A store with generous timeouts (a loaded 2-core host), checked and closed after the test."""
    s = ClusterStore(redis_cluster.nodes, NS, timeout_s=0.5, retry_after_s=0.2)
    yield s
    s.check_invariants()
    s.close()


@pytest.fixture
def bare(redis_cluster):  # noqa: F811
    client = BareClient(startup_nodes=[ClusterNode(*n.split(":")) for n in redis_cluster.nodes])
    yield client
    client.close()


def test_run_round_trips_with_identical_bytes(store):
    blocks = chain(12)
    assert store.put(blocks) == 12
    assert ask(store, blocks) == blocks
    assert ask(store, blocks[:5]) == blocks[:5]
    stats = store.stats()
    assert set(stats) == set(STAT_NAMES)
    assert (stats["written"], stats["hits"], stats["misses"]) == (12, 17, 0)


def test_missing_middle_block_cuts_the_run(store, bare):
    blocks = chain(8)
    store.put(blocks)
    bare.delete(store.key(blocks[3].block_hash))
    assert ask(store, blocks) == blocks[:3]
    assert store.stats()["misses"] == 5


def test_unknown_prefix_is_an_empty_run(store):
    assert ask(store, chain(4)) == []
    assert store.get_run([], []) == []


@pytest.mark.parametrize("damage", ["flip_kv_byte", "flip_token_byte", "truncate", "garbage",
                                    "other_blocks_value", "written_under_wrong_key"])
def test_damaged_value_is_counted_deleted_and_not_served(store, bare, damage):
    """A value that fails its check must never be returned, and must be deleted from the cluster."""
    blocks = chain(6)
    store.put(blocks)
    key = store.key(blocks[2].block_hash)
    value = bytearray(bare.get(key))
    if damage == "flip_kv_byte":
        value[-100] ^= 0x01
    elif damage == "flip_token_byte":
        value[50] ^= 0x80
    elif damage == "truncate":
        value = value[:-1]
    elif damage == "garbage":
        value = bytearray(b"not a block at all")
    elif damage == "other_blocks_value":  # intact value of a later block stored under this key
        value = bytearray(bare.get(store.key(blocks[4].block_hash)))
    else:  # right parent, tokens and KV, checksum good, but the stored hash is another block's
        b = blocks[2]
        value = bytearray(encode(ClusterBlock(blocks[5].block_hash, b.parent_hash, b.token_ids, b.kv)))
    bare.set(key, bytes(value))
    assert ask(store, blocks) == blocks[:2]
    assert store.stats()["corrupt"] == 1
    assert bare.get(key) is None
    assert store.put(blocks[2:3]) == 1  # the owner writes it again: served again
    assert ask(store, blocks) == blocks


def test_broken_parent_chain_is_not_served(store):
    """Block i's stored parent must be block i-1: a run stitched from two prefixes is refused."""
    a, b = chain(3), chain(3)
    store.put(a + b)
    stitched = [a[0], a[1], b[2]]
    assert ask(store, stitched) == a[:2]
    assert store.stats()["corrupt"] == 1


def test_other_token_ids_are_never_served(store, bare):
    """A hash collision (simulated: same hashes, other tokens asked) must not serve the KV."""
    blocks = chain(4)
    store.put(blocks)
    other = [b.token_ids for b in blocks]
    other[1] = (7).to_bytes(4, "little") * 16
    assert store.get_run([b.block_hash for b in blocks], other) == blocks[:1]
    assert store.stats()["mismatch"] == 1
    assert bare.get(store.key(blocks[1].block_hash)) is None


def test_two_namespaces_never_see_each_other(redis_cluster, store):  # noqa: F811
    blocks = chain(5)
    other = ClusterStore(redis_cluster.nodes, b"tenant-b/test-layout", timeout_s=0.5)
    try:
        assert store.put(blocks) == 5
        assert ask(other, blocks) == []
        assert ask(store, blocks) == blocks  # positive control: the blocks are there
        assert other.put(blocks[:2]) == 2
        assert ask(other, blocks) == blocks[:2]
        assert store.key(blocks[0].block_hash) != other.key(blocks[0].block_hash)
    finally:
        other.close()


def test_caller_bugs_raise(store):
    good = chain(1)[0]
    with pytest.raises(ValueError, match="16 bytes"):
        store.put([ClusterBlock(b"short", good.parent_hash, good.token_ids, good.kv)])
    with pytest.raises(ValueError, match="int32"):
        store.put([ClusterBlock(good.block_hash, good.parent_hash, b"abc", good.kv)])
    with pytest.raises(ValueError, match="token id blocks"):
        store.get_run([good.block_hash], [])
    with pytest.raises(ValueError, match="bytes"):
        ClusterStore(["127.0.0.1:1"], b"")
    with pytest.raises(ValueError, match="host:port"):
        ClusterStore(["nohost"], NS)


def test_killed_node_is_a_miss_then_serves_after_restart(redis_cluster, store, caplog):  # noqa: F811
    """A dead node must turn into misses and skipped writes (no exception), logged once per outage."""
    caplog.set_level(logging.WARNING, logger="prefixd.storage.cluster_nodes")
    blocks = chain(24)
    assert store.put(blocks) == 24
    redis_cluster.kill(1)
    try:
        run = ask(store, blocks)
        assert run == blocks[:len(run)] and len(run) < 24
        errors = store.stats()["errors"]
        assert errors >= 1
        # Inside retry_after_s the dead node is not asked again: no new error, blocks skipped.
        again = ask(store, blocks)
        assert again == run
        assert store.put(chain(24)) < 24
        stats = store.stats()
        assert stats["errors"] == errors and stats["skipped_down"] > 0
        time.sleep(0.3)  # past retry_after_s: asked again, fails again, the same outage
        assert ask(store, blocks) == run
        assert store.stats()["errors"] > errors
    finally:
        redis_cluster.restart(1)
    # The restarted node lost its keys; the owner writes the run again and it is served.
    assert put_until_written(store, blocks) == 24
    assert ask(store, blocks) == blocks
    lines = [r.getMessage() for r in caplog.records]
    assert sum("cluster node down" in m for m in lines) == 1, lines
    assert sum("cluster node back" in m for m in lines) == 1, lines


def test_put_and_get_run_on_two_threads_serve_only_right_bytes(store):
    """put (a write-behind thread) and get_run (the engine thread) at once: no error, no
    wrong block, every run a leading run of what was written."""
    chains = [chain(6) for _ in range(40)]
    failures: list[BaseException] = []

    def write():
        try:
            for c in chains:
                store.put(c)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failures.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    while writer.is_alive():
        for c in chains:
            run = ask(store, c)
            assert run == c[:len(run)]
    writer.join()
    assert not failures
    assert all(ask(store, c) == c for c in chains)


def test_silent_node_times_out_into_a_miss(redis_cluster):  # noqa: F811
    """A node that accepts but never answers (SIGSTOP) costs a timeout, not a hang or an error."""
    store = ClusterStore(redis_cluster.nodes, NS, timeout_s=0.05, retry_after_s=0.2)
    blocks = chain(24)
    try:
        assert store.put(blocks) == 24
        redis_cluster.pause(2)
        try:
            run = ask(store, blocks)
        finally:
            redis_cluster.resume(2)
        assert run == blocks[:len(run)] and len(run) < 24
        assert store.stats()["timeouts"] >= 1
    finally:
        store.close()
    redis_cluster.wait_ok()


def test_stopped_cluster_is_a_miss_and_the_store_reconnects(redis_cluster):  # noqa: F811
    """Every node down, the store's slot map included: misses, skipped writes, then serving again."""
    fresh = ClusterStore(redis_cluster.nodes, NS, timeout_s=0.5, retry_after_s=0.2)
    blocks = chain(6)
    for i in range(3):
        redis_cluster.kill(i)
    try:
        assert ask(fresh, blocks) == []       # never reached the cluster: no slot map at all
        assert fresh.put(blocks) == 0
        assert fresh.stats()["skipped_down"] == 12
    finally:
        redis_cluster.restart(0, wait=False)
        redis_cluster.restart(1, wait=False)
        redis_cluster.restart(2)
    try:
        assert put_until_written(fresh, blocks) == 6  # the store retries every retry_after_s by itself
        assert ask(fresh, blocks) == blocks
        fresh.check_invariants()
    finally:
        fresh.close()


def test_out_of_memory_skips_writes_and_keeps_serving(redis_cluster, store):  # noqa: F811
    """A cluster on noeviction at maxmemory refuses SETs: counted as oom, never raised."""
    kept = chain(4)
    assert store.put(kept) == 4
    redis_cluster.config_set("maxmemory-policy", "noeviction")
    redis_cluster.config_set("maxmemory", "1")
    try:
        refused = chain(8)
        assert store.put(refused) == 0
        assert store.stats()["oom"] == 8
        assert ask(store, kept) == kept
        assert ask(store, refused) == []
    finally:
        redis_cluster.config_set("maxmemory", redis_cluster.maxmemory)
        redis_cluster.config_set("maxmemory-policy", redis_cluster.maxmemory_policy)
    assert store.put(refused) == 8


def test_restarted_node_is_used_at_once_by_connections_idle_through_the_outage(redis_cluster):  # noqa: F811
    """Bug (found by the engine's kill/restart test): only the thread that saw a node die replaced
    its connection; the writer thread's idle connection to it, closed by the dead process, failed
    once more after the restart and opened a second outage (a log line, retry_after_s of misses)."""
    store = ClusterStore(redis_cluster.nodes, NS, timeout_s=0.5, retry_after_s=0.2)
    blocks = chain(24)
    writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # one thread, like write-behind
    try:
        assert writer.submit(store.put, blocks).result() == 24  # the writer's connections, then idle
        assert ask(store, blocks) == blocks
        redis_cluster.kill(1)
        assert len(ask(store, blocks)) < 24                      # the reader sees the outage
        redis_cluster.restart(1)
        time.sleep(0.3)                                          # past retry_after_s
        errors = store.stats()["errors"]
        assert writer.submit(store.put, blocks).result() == 24   # must not fail on the stale socket
        assert store.stats()["errors"] == errors
        assert ask(store, blocks) == blocks
    finally:
        writer.shutdown()
        store.close()


def test_closed_store_answers_misses_and_skips_writes(redis_cluster, caplog):  # noqa: F811
    """After close (an engine shutting down while its writer drains), calls neither raise nor
    report the cluster down."""
    store = ClusterStore(redis_cluster.nodes, NS, timeout_s=0.5)
    blocks = chain(3)
    assert store.put(blocks) == 3
    store.close()
    caplog.set_level(logging.WARNING, logger="prefixd.storage.cluster_nodes")
    assert store.put(blocks) == 0
    assert ask(store, blocks) == []
    assert not caplog.records
