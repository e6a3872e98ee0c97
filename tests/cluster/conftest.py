"""Fixtures for the cluster tier's tests: ``redis_cluster`` (see ``tests.cluster.redis_fixture``)."""

from tests.cluster.redis_fixture import redis_cluster  # noqa: F401  (a fixture, used by name)
