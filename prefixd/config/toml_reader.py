"""Reading the config file: a TOML document into ``EngineConfig`` and ``DaemonConfig``.

Only the form is handled here: which tables and keys exist (an unknown one is refused, naming
the known ones: a misspelt key silently left at its default is worse than a refusal), and how
TOML spells what the dataclasses hold (``use_cuda = "auto"``, a socket ``mode = "0660"``, per
model block sizes). Every value is checked by the settings classes themselves, so a config
built in code is checked the same way. ``prefixd.config.toml_writer`` writes the ``[engine]``
table back.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from prefixd.config.budget_settings import BudgetSpec
from prefixd.config.cluster_settings import CLUSTER_KEYS, ClusterConfig
from prefixd.config.daemon_settings import (DaemonConfig, EventsConfig, Limits, MetricsConfig,
                                            TenantSocket)
from prefixd.config.engine_settings import EngineConfig, Tenant, TierSizes
from prefixd.config.errors import ConfigError
from prefixd.config.kv_events_settings import KVEventsConfig

SCALAR_KEYS = ("sync", "sync_interval_ms", "write_policy", "eviction", "verify",
               "checkpoint_records", "checkpoint_blocks", "spill_blocks", "reclaim_grace_s",
               "shm_dir", "use_cuda", "forget_missing_tier")
ENGINE_KEYS = SCALAR_KEYS + ("budget", "blocks", "tenants", "cluster")
_TIER_KEYS = ("device", "host", "disk")


def load(path: str | None) -> tuple[EngineConfig, DaemonConfig]:
    """The engine and daemon configs of a TOML file (both defaults without one).

    Raises ConfigError: unreadable file, bad TOML, an unknown table or key, a bad value.
    """
    if path is None:
        return EngineConfig(), DaemonConfig()
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    refuse_unknown("the config file's top level", doc, ["engine", "daemon"])
    return engine_config(doc.get("engine", {})), daemon_config(doc.get("daemon", {}))


def read_engine_config(source: str | os.PathLike | bytes) -> EngineConfig:
    """The ``EngineConfig`` of a TOML document's ``[engine]`` table (a path, or the document's
    bytes). A document without an ``[engine]`` table gives the defaults; other tables are
    ignored.

    Raises:
        ConfigError: unreadable file, bad TOML, or a bad value (the message says which).
    """
    if isinstance(source, bytes):
        where, text = "<bytes>", source.decode("utf-8", "replace")
    else:
        where = os.fspath(source)
        try:
            with open(where, "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {where}: {exc.strerror}") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {where} is not valid TOML: {exc}") from exc
    table = doc.get("engine", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config {where}: engine must be a table ([engine]), got {table!r}")
    return engine_config(table)


def refuse_unknown(where: str, table: Mapping[str, Any], known) -> None:
    """ConfigError naming the unknown keys of ``table`` (at ``[where]``) and the known ones."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(repr(k) for k in unknown)} in [{where}]: the known keys "
                          f"are {', '.join(known)}")


def _table(where: str, value) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{where}] must be a table, got {value!r}")
    return value


def engine_config(table: Mapping[str, Any]) -> EngineConfig:
    """From the ``[engine]`` table as a mapping (what ``tomllib`` returns).

    Raises:
        ConfigError: an unknown key (naming the known ones) or a bad value.
    """
    table = _table("engine", table)
    refuse_unknown("engine", table, ENGINE_KEYS)
    kwargs = {key: table[key] for key in SCALAR_KEYS if key in table}
    if kwargs.get("use_cuda") == "auto":
        kwargs["use_cuda"] = None
    if "budget" in table:
        budget = _table("engine.budget", table["budget"])
        refuse_unknown("engine.budget", budget, _TIER_KEYS)
        kwargs["budget"] = BudgetSpec(**budget)
    if "blocks" in table:
        blocks = _table("engine.blocks", table["blocks"])
        refuse_unknown("engine.blocks", blocks, _TIER_KEYS + ("models",))
        default = TierSizes(**{k: blocks[k] for k in _TIER_KEYS if k in blocks})
        if any(k in blocks for k in _TIER_KEYS):
            kwargs["blocks"] = default
        models = []
        for model_id, sizes in _table("engine.blocks.models", blocks.get("models", {})).items():
            where = f'engine.blocks.models."{model_id}"'
            sizes = _table(where, sizes)
            refuse_unknown(where, sizes, _TIER_KEYS)
            try:
                models.append((model_id, dataclasses.replace(default, **sizes)))
            except ConfigError as exc:
                raise ConfigError(f"in [{where}]: {exc}") from None
        kwargs["model_blocks"] = tuple(models)
    if "tenants" in table:
        kwargs["tenants"] = _tenants(table["tenants"])
    if "cluster" in table:
        kwargs["cluster"] = cluster_config(table["cluster"])
    return EngineConfig(**kwargs)


def _tenants(tenants) -> tuple[Tenant, ...]:
    if not isinstance(tenants, list):
        raise ConfigError("engine.tenants must be an array of tables: write each tenant as "
                          "[[engine.tenants]] with name = \"...\" and salt = \"...\"")
    parsed = []
    for i, entry in enumerate(tenants):
        entry = _table(f"engine.tenants[{i}]", entry)
        refuse_unknown(f"engine.tenants[{i}]", entry, ("name", "salt", "max", "reserved"))
        if "name" not in entry:
            raise ConfigError(f"[[engine.tenants]] number {i + 1} has no name: "
                              f"add name = \"...\"")
        salt = entry.get("salt", "")
        if not isinstance(salt, str):
            raise ConfigError(f"tenant {entry['name']!r}: salt must be a string, got {salt!r}")
        parsed.append(Tenant(entry["name"], salt, **{k: entry[k] for k in ("max", "reserved")
                                                     if k in entry}))
    return tuple(parsed)


def cluster_config(table: Mapping[str, Any]) -> ClusterConfig:
    """From the ``[engine.cluster]`` table (what ``tomllib`` returns).

    Raises:
        ConfigError: not a table, an unknown key (naming the known ones), no ``nodes``, or a
            bad value.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"[engine.cluster] must be a table, got {table!r}")
    refuse_unknown("engine.cluster", table, CLUSTER_KEYS)
    if "nodes" not in table:
        raise ConfigError("[engine.cluster] has no nodes: add nodes = [\"host:port\", ...] "
                          "(or remove the table to run without a cluster tier)")
    return ClusterConfig(**table)


def daemon_config(table: Mapping[str, Any]) -> DaemonConfig:
    """From a ``[daemon]`` table; unknown keys are refused, naming the known ones."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"[daemon] must be a table, got {table!r}")
    known = [f.name for f in dataclasses.fields(DaemonConfig)]
    refuse_unknown("daemon", table, known)
    kwargs = {k: v for k, v in table.items()
              if k not in ("limits", "sockets", "metrics", "events", "kv_events")}
    for key, cls in (("events", EventsConfig), ("kv_events", KVEventsConfig),
                     ("metrics", MetricsConfig), ("limits", Limits)):
        if key in table:
            sub = table[key]
            if not isinstance(sub, Mapping):
                raise ConfigError(f"[daemon.{key}] must be a table, got {sub!r}")
            refuse_unknown(f"daemon.{key}", sub, [f.name for f in dataclasses.fields(cls)])
            kwargs[key] = cls(**sub)
    if "sockets" in table:
        kwargs["sockets"] = _sockets(table["sockets"])
    try:
        return DaemonConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"[daemon]: {exc}") from None


def _sockets(entries) -> tuple[TenantSocket, ...]:
    if not isinstance(entries, list):
        raise ConfigError("daemon.sockets must be an array of tables: [[daemon.sockets]]")
    sockets = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "tenant" not in entry or "path" not in entry:
            raise ConfigError(f"[[daemon.sockets]] number {i + 1} needs tenant = \"...\" "
                              f"and path = \"...\"")
        refuse_unknown(f"daemon.sockets[{i}]", entry, ["tenant", "path", "owner", "group", "mode"])
        entry = dict(entry)
        if "mode" in entry:
            entry["mode"] = _octal(entry["mode"], entry["tenant"])
        sockets.append(TenantSocket(**entry))
    return tuple(sockets)


def _octal(value, tenant: str) -> int:
    if isinstance(value, str):
        try:
            return int(value, 8)
        except ValueError:
            pass
    raise ConfigError(f"daemon.sockets: mode of tenant {tenant!r} must be an octal string like "
                      f"\"0660\", got {value!r}")
