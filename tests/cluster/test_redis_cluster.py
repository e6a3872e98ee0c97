"""The test cluster itself (``prefixd.tools.redis_cluster``): slots spread, kill loses keys, restart rejoins."""

from redis.cluster import ClusterNode, RedisCluster as Client


def _client(cluster):
    return Client(startup_nodes=[ClusterNode(*n.split(":")) for n in cluster.nodes])


def test_cluster_has_three_masters_and_a_restarted_node_rejoins_empty(redis_cluster):
    """kill(i) must be a real crash (the node's keys are gone) and restart(i) must rejoin it."""
    client = _client(redis_cluster)
    try:
        masters = {n.name for n in client.get_primaries()}
        assert masters == set(redis_cluster.nodes)
        keys = [f"k{i}".encode() for i in range(64)]
        for k in keys:
            client.set(k, k)
        victim_port = redis_cluster.ports[1]
        on_victim = [k for k in keys if client.get_node_from_key(k).port == victim_port]
        assert on_victim and len(on_victim) < len(keys)
        redis_cluster.kill(1)
        redis_cluster.restart(1)
        assert all(client.get(k) is None for k in on_victim)
        assert all(client.get(k) == k for k in keys if k not in on_victim)
    finally:
        client.close()
