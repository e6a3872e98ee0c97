"""The TOML form of ``EngineConfig``: the ``[engine]`` table read, checked for unknown keys, and
written back (``EngineConfig.from_toml`` / ``to_toml`` call these; values are checked by the
dataclasses themselves)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

from prefixd.engine.cluster_config import ClusterConfig
from prefixd.engine.config import EngineConfig, Tenant, TierSizes
from prefixd.engine.errors import ConfigError


def engine_table(source: str | os.PathLike | bytes) -> Mapping[str, Any]:
    """The ``[engine]`` table of a TOML document (a path, or its bytes); empty when absent."""
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
    return table


def to_table(config: EngineConfig) -> dict[str, Any]:
    """The ``[engine]`` table of ``config`` (plain values, what ``tomllib`` would return)."""
    blocks: dict[str, Any] = dataclasses.asdict(config.blocks)
    if config.model_blocks:
        blocks["models"] = {m: dataclasses.asdict(s) for m, s in config.model_blocks}
    table: dict[str, Any] = {key: getattr(config, key) for key in _SCALAR_KEYS}
    table["use_cuda"] = "auto" if config.use_cuda is None else config.use_cuda
    if config.checkpoint_blocks is None:
        del table["checkpoint_blocks"]
    table["blocks"] = blocks
    tenants = []
    for t in config.tenants:
        try:
            tenants.append({"name": t.name, "salt": t.salt.decode()})
        except UnicodeDecodeError:
            raise ConfigError(f"tenant {t.name!r}: its salt is not UTF-8 text and cannot be "
                              f"written to a TOML file; use a text salt") from None
    table["tenants"] = tenants
    if config.cluster is not None:
        table["cluster"] = config.cluster.to_table()
    return table


def dump_engine_table(table: Mapping[str, Any]) -> str:
    """``table`` as a TOML document with one ``[engine]`` table."""
    lines: list[str] = []
    _dump_table("engine", table, lines)
    return "\n".join(lines) + "\n"


_SCALAR_KEYS = ("sync", "sync_interval_ms", "write_policy", "eviction", "verify",
                "checkpoint_records", "checkpoint_blocks", "spill_blocks", "reclaim_grace_s",
                "shm_dir", "use_cuda", "forget_missing_tier")
ENGINE_KEYS = _SCALAR_KEYS + ("blocks", "tenants", "cluster")
_TIER_KEYS = ("device", "host", "disk")


def refuse_unknown(where: str, table: Mapping[str, Any], known) -> None:
    """ConfigError naming the unknown keys of ``table`` (at ``[where]``) and the known ones
    (the daemon's ``[daemon]`` table is checked with it too)."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(repr(k) for k in unknown)} in [{where}]: the known keys "
                          f"are {', '.join(known)}")


def _table(where: str, value) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{where}] must be a table, got {value!r}")
    return value


def config_kwargs(table: Mapping[str, Any]) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from an ``[engine]`` table (values checked later)."""
    table = _table("engine", table)
    refuse_unknown("engine", table, ENGINE_KEYS)
    kwargs = {key: table[key] for key in _SCALAR_KEYS if key in table}
    if kwargs.get("use_cuda") == "auto":
        kwargs["use_cuda"] = None
    if "blocks" in table:
        blocks = _table("engine.blocks", table["blocks"])
        refuse_unknown("engine.blocks", blocks, _TIER_KEYS + ("models",))
        default = TierSizes(**{k: blocks[k] for k in _TIER_KEYS if k in blocks})
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
        tenants = table["tenants"]
        if not isinstance(tenants, list):
            raise ConfigError("engine.tenants must be an array of tables: write each tenant as "
                              "[[engine.tenants]] with name = \"...\" and salt = \"...\"")
        parsed = []
        for i, entry in enumerate(tenants):
            entry = _table(f"engine.tenants[{i}]", entry)
            refuse_unknown(f"engine.tenants[{i}]", entry, ("name", "salt"))
            if "name" not in entry:
                raise ConfigError(f"[[engine.tenants]] number {i + 1} has no name: "
                                  f"add name = \"...\"")
            salt = entry.get("salt", "")
            if not isinstance(salt, str):
                raise ConfigError(f"tenant {entry['name']!r}: salt must be a string, got {salt!r}")
            parsed.append(Tenant(entry["name"], salt))
        kwargs["tenants"] = tuple(parsed)
    if "cluster" in table:
        kwargs["cluster"] = ClusterConfig.from_table(table["cluster"])
    return kwargs


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON string escapes are TOML basic-string escapes; DEL must be escaped in TOML too.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)) and not any(isinstance(v, Mapping) for v in value):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} as a TOML value")


def _dump_table(name: str, table: Mapping[str, Any], lines: list[str]) -> None:
    """Append ``[name]`` and its keys: scalars, then sub-tables, then arrays of tables."""
    if lines:
        lines.append("")
    lines.append(f"[{name}]")
    nested = []
    for key, value in table.items():
        if isinstance(value, Mapping) or (isinstance(value, list) and value
                                          and all(isinstance(v, Mapping) for v in value)):
            nested.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in nested:
        if isinstance(value, Mapping):
            _dump_table(f"{name}.{_toml_key(key)}", value, lines)
            continue
        for item in value:
            lines.extend(("", f"[[{name}.{_toml_key(key)}]]"))
            lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in item.items())
