"""The cluster tier through the engine, with a real 3-master Redis Cluster (issue 15).

Two engines on two state directories stand for two hosts; every block they serve is compared
with the bytes it must hold (``hosts.kv_of``), so "0 wrong bytes" is checked, not assumed.
"""

import time

import pytest
import redis

from tests.cluster.hosts import BS, LAYOUT, config, host, prompt, serve, served

pytestmark = pytest.mark.usefixtures("redis_cluster")


@pytest.fixture
def hosts(tmp_path, redis_cluster):
    """``(a, b)``: the ``acme`` pools of two engines sharing the cluster; closed after."""
    cfg = config(tmp_path, redis_cluster.nodes)
    engines = [host(tmp_path, "a", cfg), host(tmp_path, "b", cfg)]
    yield [e.pool("acme", LAYOUT) for e in engines]
    for e in engines:
        e.close()


def _check(*pools):
    for dc in pools:
        dc.check_invariants()


def test_a_prefix_committed_on_one_host_is_a_hit_on_another(hosts):
    a, b = hosts
    tokens = prompt(1)
    serve(a, tokens)
    assert a.cluster.drain()
    _check(a, b)
    assert a.cluster.stats()["remote_written"] == 10
    assert served(b, tokens) == (10 * BS, 0)  # every servable block, identical bytes
    stats = b.cluster.stats()
    assert (stats["remote_hit_blocks"], stats["remote_hit_tokens"]) == (10, 10 * BS)
    _check(a, b)
    # the promoted blocks are b's own now: indexed, logged, a local hit with no new fetch
    fetches = stats["fetches"]
    assert served(b, tokens) == (10 * BS, 0)
    assert b.cluster.stats()["fetches"] == fetches
    assert b.cache.stats.committed_blocks == 0  # promotions are not counted as commits
    _check(a, b)


def test_a_longer_prompt_fetches_only_past_its_local_match(hosts):
    a, b = hosts
    base = prompt(2, 6)
    serve(b, base[:6 * BS + 1])  # b computed the first 6 blocks itself
    longer = base[:6 * BS] + prompt(3, 4)
    serve(a, longer)
    assert a.cluster.drain()
    hits_before = b.cluster.stats()["remote_hit_blocks"]
    assert served(b, longer) == (10 * BS, 0)
    assert b.cluster.stats()["remote_hit_blocks"] - hits_before == 4
    _check(a, b)


def test_a_killed_cluster_node_costs_hits_never_bytes(hosts, redis_cluster):
    a, b = hosts
    wrong = 0

    def step(k: int) -> int:
        """One prompt served by one host and fetched by the other (they swap each step);
        returns the blocks the reader got from the cluster (or its own cache)."""
        nonlocal wrong
        writer, reader = (a, b) if k % 2 else (b, a)
        tokens = prompt(100 + k)
        serve(writer, tokens)
        assert writer.cluster.drain()
        cached, bad = served(reader, tokens)
        wrong += bad
        _check(a, b)
        return cached // BS

    up = [step(k) for k in range(8)]
    assert up == [10] * 8, (a.cluster.stats(), b.cluster.stats())  # all up: every block a hit
    redis_cluster.kill(1)
    try:
        down = [step(k) for k in range(8, 16)]
    finally:
        redis_cluster.restart(1)
    assert min(down) < 10  # a third of the keys lived on the dead node: runs are cut there
    skipped = a.cluster.stats()["remote_skipped_down"] + b.cluster.stats()["remote_skipped_down"]
    assert skipped > 0
    # back by itself: the store retries a down node after retry_after_s, no one tells it
    after, k, deadline = [], 16, time.monotonic() + 20
    while after[-3:] != [10] * 3 and time.monotonic() < deadline:
        after.append(step(k))
        k += 1
        time.sleep(0.05)
    assert after[-3:] == [10] * 3, after
    assert wrong == 0


def test_a_corrupt_value_in_redis_is_detected_and_not_served(hosts, redis_cluster):
    a, b = hosts
    tokens = prompt(4)
    serve(a, tokens)
    assert a.cluster.drain()
    fleet = a.cluster.fleet_hashes(b"".join(t.to_bytes(4, "little") for t in tokens), b"", 10)
    key = a.cluster.remote.key(fleet[6])
    host_, port = redis_cluster.nodes[0].rsplit(":", 1)
    client = redis.RedisCluster(host=host_, port=int(port))
    try:
        value = client.get(key)
        at = len(value) - 40  # inside the KV bytes, before the checksum
        client.setrange(key, at, bytes([value[at] ^ 0x5A]))
        assert served(b, tokens) == (6 * BS, 0)  # cut before the damaged block
        assert b.cluster.stats()["remote_corrupt"] == 1
        assert client.get(key) is None  # deleted: the writer's next put restores it
    finally:
        client.close()
    _check(a, b)


def test_tenants_never_hit_each_others_blocks_across_hosts(tmp_path, redis_cluster):
    cfg = config(tmp_path, redis_cluster.nodes)
    first, second = host(tmp_path, "a", cfg), host(tmp_path, "b", cfg)
    try:
        tokens = prompt(5)
        acme_a = first.pool("acme", LAYOUT)
        serve(acme_a, tokens, label="acme")
        assert acme_a.cluster.drain()
        globex_b = second.pool("globex", LAYOUT)
        assert served(globex_b, tokens, label="globex") == (0, 0)
        assert globex_b.cluster.stats()["fetches"] == 1  # it asked, and the cluster had nothing
        assert globex_b.cluster.stats()["remote_hit_blocks"] == 0
        acme_b = second.pool("acme", LAYOUT)  # positive control: same tenant, other host
        assert served(acme_b, tokens, label="acme") == (10 * BS, 0)
        first.check_invariants()
        second.check_invariants()
    finally:
        first.close()
        second.close()


def test_a_restarted_engine_keeps_promoted_blocks_and_still_fetches(tmp_path, redis_cluster):
    cfg = config(tmp_path, redis_cluster.nodes)
    a, b = host(tmp_path, "a", cfg), host(tmp_path, "b", cfg)
    try:
        pa, pb = a.pool("acme", LAYOUT), b.pool("acme", LAYOUT)
        old, new = prompt(6), prompt(7)
        serve(pa, old)
        assert pa.cluster.drain()
        assert served(pb, old) == (10 * BS, 0)
        b.tick()  # the daemon's loop writes promoted blocks down
        b.check_invariants()
        b.close()
        b = host(tmp_path, "b", cfg)
        pb = b.pool("acme", LAYOUT)
        b.check_invariants()
        assert served(pb, old) == (10 * BS, 0)  # a local hit: the promotion was logged
        assert pb.cluster.stats()["fetches"] == 0
        serve(pa, new)
        assert pa.cluster.drain()
        assert served(pb, new) == (10 * BS, 0)  # and the cluster still serves it
        assert pb.cluster.stats()["remote_hit_blocks"] == 10
        a.check_invariants()
        b.check_invariants()
    finally:
        a.close()
        b.close()


def test_a_promoting_open_with_every_master_frozen_is_a_miss_within_one_timeout(tmp_path, redis_cluster):
    """Regression: the fetch behind a promoting open waited ``timeout_ms`` per frozen master,
    in turn (3 x 500 ms). The bound allows half a timeout for a loaded host's scheduling,
    where a second master's own timeout would add a whole one."""
    cfg = config(tmp_path, redis_cluster.nodes, timeout_ms=1000, retry_after_s=60.0)
    engines = [host(tmp_path, "a", cfg), host(tmp_path, "b", cfg)]
    a, b = (e.pool("acme", LAYOUT) for e in engines)
    try:
        tokens = prompt(7)
        serve(a, tokens)
        assert a.cluster.drain()
        assert served(b, prompt(8)) == (0, 0)  # b's connections and slot map, made while all is up
        for i in range(3):
            redis_cluster.pause(i)
        try:
            t0 = time.monotonic()
            got = served(b, tokens)
            elapsed = time.monotonic() - t0
        finally:
            for i in range(3):
                redis_cluster.resume(i)
            redis_cluster.wait_ok()
        assert got == (0, 0)
        assert elapsed < 1.5, f"a promoting open took {elapsed:.2f} s with timeout_ms=1000"
        _check(a, b)
    finally:
        for e in engines:
            e.close()
