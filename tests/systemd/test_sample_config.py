"""``systemd/prefixd.toml``, the sample config installed as /etc/prefixd/prefixd.toml: it loads,
equals the built-in defaults, and names every setting (a new setting must be added to it)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from prefixd.config.budget_settings import BudgetSpec
from prefixd.config.cluster_settings import ClusterConfig
from prefixd.config.kv_events_settings import KVEventsConfig
from prefixd.config.daemon_settings import (DaemonConfig, EventsConfig, Limits, MetricsConfig,
                                            TenantSocket)
from prefixd.config.engine_settings import EngineConfig, TierSizes
from prefixd.config.toml_reader import load

SAMPLE = pathlib.Path(__file__).resolve().parents[2] / "systemd" / "prefixd.toml"

# dataclass fields that the file spells differently
SPELLED = {"model_blocks": "[engine.blocks.models.", "blocks": "[engine.blocks]",
           "tenants": "[[engine.tenants]]", "limits": "[daemon.limits]",
           "sockets": "[[daemon.sockets]]", "metrics": "[daemon.metrics]",
           "events": "[daemon.events]", "cluster": "[engine.cluster]",
           "budget": "[engine.budget]", "kv_events": "[daemon.kv_events]"}


def test_sample_config_loads_and_equals_the_defaults():
    engine, daemon = load(str(SAMPLE))
    assert engine == EngineConfig()
    assert daemon == DaemonConfig()


def test_sample_config_names_every_setting():
    """Also the ones left at an absent default (commented out): ``checkpoint_blocks``,
    ``socket``, the per-model sizes and ``[[daemon.sockets]]``."""
    text = SAMPLE.read_text()
    missing = []
    for cls in (EngineConfig, TierSizes, DaemonConfig, Limits, TenantSocket, MetricsConfig,
                EventsConfig, ClusterConfig, BudgetSpec, KVEventsConfig):
        for field in dataclasses.fields(cls):
            spelled = SPELLED.get(field.name)
            if spelled is not None:
                found = spelled in text
            else:
                found = re.search(rf"^#? ?{field.name} = ", text, re.M) is not None
            if not found:
                missing.append(f"{cls.__name__}.{field.name}")
    assert not missing, f"systemd/prefixd.toml does not show {missing}: add them with their default"


def test_sample_config_marks_exactly_the_live_settings():
    """The ``[live]`` marks in the sample are what a reload applies (``prefixd.config.live_keys``)."""
    from prefixd.config.live_keys import DAEMON_LIVE_KEYS, ENGINE_LIVE_KEYS

    marked = set()
    for line in SAMPLE.read_text().splitlines():
        if "[live]" not in line:
            continue
        found = re.match(r"^#? ?(\w+) = |^\[+([\w.]+)\]+", line)
        if found:  # a setting or a table, not prose
            marked.add((found.group(1) or found.group(2)).split(".")[-1])
    assert marked == set(ENGINE_LIVE_KEYS) | (set(DAEMON_LIVE_KEYS) - {"sockets"}) | {"mode"}
