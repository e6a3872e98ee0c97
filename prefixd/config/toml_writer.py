"""Writing the ``[engine]`` table: an ``EngineConfig`` as plain values and as a TOML document
that ``prefixd.config.toml_reader.read_engine_config`` turns back into the same config
(``tomllib`` reads TOML but does not write it)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from prefixd.config.cluster_settings import ClusterConfig
from prefixd.config.engine_settings import EngineConfig
from prefixd.config.errors import ConfigError
from prefixd.config.toml_reader import SCALAR_KEYS


def engine_toml(config: EngineConfig) -> str:
    """``config`` as a TOML document with one ``[engine]`` table.

    Raises:
        ConfigError: a tenant salt that is not UTF-8 text (TOML holds only text).
    """
    lines: list[str] = []
    _dump_table("engine", engine_table(config), lines)
    return "\n".join(lines) + "\n"


def engine_table(config: EngineConfig) -> dict[str, Any]:
    """The ``[engine]`` table of ``config`` (plain values, what ``tomllib`` would return), which
    ``toml_reader.engine_config`` turns back into this config.

    Raises:
        ConfigError: a tenant salt that is not UTF-8 text (TOML holds only text).
    """
    blocks: dict[str, Any] = {} if config.blocks is None else dataclasses.asdict(config.blocks)
    if config.model_blocks:
        blocks["models"] = {m: dataclasses.asdict(s) for m, s in config.model_blocks}
    table: dict[str, Any] = {key: getattr(config, key) for key in SCALAR_KEYS}
    table["use_cuda"] = "auto" if config.use_cuda is None else config.use_cuda
    if config.checkpoint_blocks is None:
        del table["checkpoint_blocks"]
    budget = {tier: getattr(config.budget, tier).text for tier in ("device", "host", "disk")
              if getattr(config.budget, tier) is not None}
    if budget:
        table["budget"] = budget
    if blocks:
        table["blocks"] = blocks
    tenants = []
    for t in config.tenants:
        try:
            entry = {"name": t.name, "salt": t.salt.decode()}
        except UnicodeDecodeError:
            raise ConfigError(f"tenant {t.name!r}: its salt is not UTF-8 text and cannot be "
                              f"written to a TOML file; use a text salt") from None
        for key in ("max", "reserved"):
            if getattr(t, key).as_table():
                entry[key] = getattr(t, key).as_table()
        tenants.append(entry)
    table["tenants"] = tenants
    if config.cluster is not None:
        table["cluster"] = cluster_table(config.cluster)
    return table


def cluster_table(cluster: ClusterConfig) -> dict[str, Any]:
    """The ``[engine.cluster]`` table that ``toml_reader.cluster_config`` turns back into
    ``cluster``."""
    table = dataclasses.asdict(cluster)
    table["nodes"] = list(cluster.nodes)
    return table


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


def _inline(table: Mapping[str, Any]) -> str:
    """A TOML inline table of scalars (a tenant's ``max = { host = "8GiB" }``)."""
    return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()) + " }"


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
            lines.extend(f"{_toml_key(k)} = {_inline(v) if isinstance(v, Mapping) else _toml_value(v)}"
                         for k, v in item.items())
