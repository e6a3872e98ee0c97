"""The ``redis_cluster`` fixture: a running 3-master Redis Cluster on loopback, one per test module.

Where ``redis-server`` is missing the tests that use it skip with the reason, except under CI
(env ``CI`` set, or running as root as ``.ci/run`` does), where a missing server is a failure:
CI installs it, so its absence there is a broken setup, not an optional feature.
"""

from __future__ import annotations

import os

import pytest

from prefixd.tools.redis_cluster import RedisCluster, server_missing_reason
from tests.requires import required


def under_ci() -> bool:
    return required() or bool(os.environ.get("CI")) or os.geteuid() == 0


def require_redis() -> None:
    """Skip (outside CI) or fail (under CI) when no Redis Cluster can be started here."""
    reason = server_missing_reason()
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"redis cluster tests need redis-server under CI: {reason}")
    pytest.skip(f"no redis cluster: {reason}")


@pytest.fixture(scope="module")
def redis_cluster():
    """A ``prefixd.tools.redis_cluster.RedisCluster`` with 3 masters; stopped after the module.

    Tests that kill a node restart it before they end (the next test expects all three up).
    """
    require_redis()
    with RedisCluster(nodes=3) as cluster:
        yield cluster
