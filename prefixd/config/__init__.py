"""Every setting of prefixd, validated, and its TOML form (DESIGN.md "The parts"): imports only
``prefixd.api``, so every part may use it, the client included.

Modules, one concept each:

- ``engine_settings``: ``EngineConfig`` (the ``[engine]`` table), ``TierSizes``, ``Tenant``;
- ``budget_settings``: ``BudgetSpec`` (``[engine.budget]``), a tenant's ``Quota``, ``Machine``
  and the resolved ``Budget`` in bytes;
- ``sizes``: ``Size``, a byte count as written ("24GiB", "50%");
- ``cluster_settings``: ``ClusterConfig`` (``[engine.cluster]``, the Redis Cluster tier);
- ``daemon_settings``: ``DaemonConfig`` (``[daemon]``), ``Limits``, ``TenantSocket``,
  ``MetricsConfig``, ``EventsConfig``;
- ``paths``: the default state directory and sockets (XDG), for the daemon and the client;
- ``live_keys``: which keys a reload applies live, and what a new file changes;
- ``toml_reader`` / ``toml_writer``: the config file in (``load``) and the ``[engine]`` table
  out; the settings classes hold no TOML code;
- ``errors``: ``ConfigError``.
"""

from prefixd.config.budget_settings import Budget, BudgetSpec, Machine, Quota
from prefixd.config.cluster_settings import ClusterConfig
from prefixd.config.daemon_settings import (DaemonConfig, EventsConfig, Limits, MetricsConfig,
                                            TenantSocket)
from prefixd.config.engine_settings import EngineConfig, Tenant, TierSizes
from prefixd.config.errors import ConfigError
from prefixd.config.sizes import Size
from prefixd.config.toml_reader import load, read_engine_config

__all__ = ["Budget", "BudgetSpec", "ClusterConfig", "ConfigError", "DaemonConfig", "EngineConfig",
           "EventsConfig", "Limits", "Machine", "MetricsConfig", "Quota", "Size", "Tenant",
           "TenantSocket", "TierSizes", "load", "read_engine_config"]
