"""Every setting of prefixd, validated, and its TOML form (DESIGN.md "The parts"): imports only
``prefixd.api``, so every part may use it, the client included.

Modules, one concept each:

- ``engine_settings``: ``EngineConfig`` (the ``[engine]`` table), ``TierSizes``, ``Tenant``;
- ``cluster_settings``: ``ClusterConfig`` (``[engine.cluster]``, the Redis Cluster tier);
- ``daemon_settings``: ``DaemonConfig`` (``[daemon]``), ``Limits``, ``TenantSocket``,
  ``MetricsConfig``, ``EventsConfig``;
- ``paths``: the default state directory and sockets (XDG), for the daemon and the client;
- ``live_keys``: which keys a reload applies live, and what a new file changes;
- ``toml_reader`` / ``toml_writer``: the config file in (``load``) and the ``[engine]`` table
  out; the settings classes hold no TOML code;
- ``errors``: ``ConfigError``.
"""

from prefixd.config.cluster_settings import ClusterConfig
from prefixd.config.daemon_settings import (DaemonConfig, EventsConfig, Limits, MetricsConfig,
                                            TenantSocket)
from prefixd.config.engine_settings import EngineConfig, Tenant, TierSizes
from prefixd.config.errors import ConfigError
from prefixd.config.toml_reader import load, read_engine_config

__all__ = ["ClusterConfig", "ConfigError", "DaemonConfig", "EngineConfig", "EventsConfig",
           "Limits", "MetricsConfig", "Tenant", "TenantSocket", "TierSizes", "load",
           "read_engine_config"]
