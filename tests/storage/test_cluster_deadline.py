"""The cluster tier's batch has one deadline, shared by every node it waits on (connects included).

A fetch (``ClusterStore.get_run``) waits at most ``timeout_s`` however many masters are silent:
the real 3-master cluster with every master frozen (SIGSTOP), over connections made before the
freeze and over fresh ones (the slot map's reload then waits on every node too), and three
listeners that never accept (a connect that hangs). A node read after another one used up the
deadline still gets its reply read if it is already there.

NOTE (the margin): each test allows ``timeout_s`` plus half of it. The deadline itself costs
``timeout_s`` plus ``MIN_WAIT_S`` (1 ms) per further node; the rest of the margin is for a
loaded 2-core host's scheduling. A second node waiting its own timeout (the bug) would add a
whole ``timeout_s``, so the bound separates one deadline from two with half a timeout to spare.
"""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from redis.cluster import ClusterNode, RedisCluster as BareClient

from prefixd.storage.cluster import ClusterStore
from prefixd.storage.cluster_nodes import ClusterLinks, NodeFailure
from tests.cluster.redis_fixture import redis_cluster  # noqa: F401  (the fixture, used by name)
from tests.storage.test_cluster_store import NS, ask, chain

TIMEOUT_S = 1.0
BOUND_S = TIMEOUT_S * 1.5


@contextlib.contextmanager
def frozen(cluster, indexes):
    """The nodes ``indexes`` SIGSTOPped inside; resumed (and the cluster healthy) after."""
    for i in indexes:
        cluster.pause(i)
    try:
        yield
    finally:
        for i in indexes:
            cluster.resume(i)
        cluster.wait_ok()


def timed_ask(store, blocks):
    t0 = time.monotonic()
    run = ask(store, blocks)
    return run, time.monotonic() - t0


def test_a_fetch_with_every_master_frozen_is_a_miss_within_one_timeout(redis_cluster):  # noqa: F811
    """Regression: ``ClusterLinks.pipeline`` gave each node's reads a fresh socket timeout, so
    with every master frozen one fetch waited one timeout per master, in turn (3 x timeout)."""
    store = ClusterStore(redis_cluster.nodes, NS, timeout_s=TIMEOUT_S, retry_after_s=60.0)
    blocks = chain(24)
    try:
        assert store.put(blocks) == 24
        assert ask(store, blocks) == blocks  # connections made and the slot map loaded
        with frozen(redis_cluster, range(3)):
            run, elapsed = timed_ask(store, blocks)
        assert run == []
        assert store.stats()["timeouts"] == 3, store.stats()  # every master was waited on
        assert elapsed < BOUND_S, f"one fetch took {elapsed:.2f} s with timeout_s={TIMEOUT_S}"
    finally:
        store.close()


def test_a_first_fetch_with_every_master_frozen_is_a_miss_within_one_timeout(redis_cluster):  # noqa: F811
    """A store with no slot map and no connection yet: the map's reload (CLUSTER SLOTS, node
    after node) and the connects share the fetch's one deadline."""
    blocks = chain(6)
    store = ClusterStore(redis_cluster.nodes, NS, timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S,
                        retry_after_s=60.0)
    try:
        with frozen(redis_cluster, range(3)):
            run, elapsed = timed_ask(store, blocks)
        assert run == []
        assert store.stats()["skipped_down"] == 6, store.stats()  # no slot map could be had
        assert elapsed < BOUND_S, f"one first fetch took {elapsed:.2f} s with timeout_s={TIMEOUT_S}"
    finally:
        store.close()


def test_a_node_read_after_the_deadline_passed_still_serves_its_reply(redis_cluster):  # noqa: F811
    """The frozen master owns the first block, so it is read first and uses up the deadline;
    the two others answered meanwhile and are read within ``MIN_WAIT_S``: one timeout, not
    three (a node failed unread once the deadline passed would count as one)."""
    store = ClusterStore(redis_cluster.nodes, NS, timeout_s=0.5, retry_after_s=60.0)
    bare = BareClient(startup_nodes=[ClusterNode(*n.split(":")) for n in redis_cluster.nodes])
    blocks = chain(24)
    try:
        assert store.put(blocks) == 24
        assert ask(store, blocks) == blocks
        owner = bare.get_node_from_key(store.key(blocks[0].block_hash))
        first = redis_cluster.nodes.index(f"{owner.host}:{owner.port}")
        with frozen(redis_cluster, [first]):
            run, elapsed = timed_ask(store, blocks)
        stats = store.stats()
        assert run == []  # the run's first block is on the frozen master
        assert stats["timeouts"] == 1 and stats["errors"] == 0, stats
        assert elapsed < 0.75, f"took {elapsed:.2f} s with timeout_s=0.5"
    finally:
        bare.close()
        store.close()


@pytest.fixture
def never_accepting():
    """Three loopback listeners whose accept queue is full: a connect to them hangs (SYN
    dropped) until its timeout, as to a host that went silent."""
    listeners, fillers = [], []
    for _ in range(3):
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(0)
        filler = socket.create_connection(lst.getsockname(), timeout=2)  # takes the one place
        listeners.append(lst)
        fillers.append(filler)
    yield [f"127.0.0.1:{lst.getsockname()[1]}" for lst in listeners]
    for s in fillers + listeners:
        s.close()


def test_connects_to_silent_nodes_share_the_batch_deadline(never_accepting):
    """Regression: each node's connect had its own ``connect_timeout_s``, in turn."""
    links = ClusterLinks(never_accepting, timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S,
                         retry_after_s=60.0)
    try:
        t0 = time.monotonic()
        out = links.pipeline({n: [("GET", b"k")] for n in never_accepting}, "get")
        elapsed = time.monotonic() - t0
    finally:
        links.close()
    assert all(isinstance(r, NodeFailure) and r.timeout for r in out.values()), out
    assert elapsed < BOUND_S, f"three connects took {elapsed:.2f} s with timeout_s={TIMEOUT_S}"
