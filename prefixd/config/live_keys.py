"""Which settings a running daemon takes without a restart, and what a new file changes.

A reload (the daemon's config watch or SIGHUP) reads the whole file again; only these settings
may differ from the running ones:

- ``[engine]`` ``ENGINE_LIVE_KEYS``: ``eviction`` (every pool's eviction queues are re-keyed),
  ``write_policy`` (runs indexed or evicted from then on follow it), ``checkpoint_records`` and
  ``checkpoint_blocks`` (the next log append compares against them);
- ``[daemon]`` ``DAEMON_LIVE_KEYS``: ``log_level``, ``lease_s``, ``shutdown_grace_s``,
  ``[daemon.limits]``, ``[daemon.metrics]``, and the ``mode`` of ``[[daemon.sockets]]`` (only
  the mode: a new path or owner needs a restart).

Everything else (pool sizes, sync, verify, shm_dir, tenants, socket paths, message sizes...)
is fixed when the daemon starts or a pool opens: the files, the WAL environment, the recovered
index and the bound sockets were made with it. The engine applies its live keys
(``prefixd.engine.live_settings``), the daemon its own (``prefixd.daemon.reload``, which has
one applier per key of ``DAEMON_LIVE_KEYS``).
"""

from __future__ import annotations

import dataclasses

from prefixd.config.daemon_settings import DaemonConfig
from prefixd.config.engine_settings import EngineConfig

ENGINE_LIVE_KEYS = ("eviction", "write_policy", "checkpoint_records", "checkpoint_blocks")
DAEMON_LIVE_KEYS = ("log_level", "lease_s", "shutdown_grace_s", "limits", "sockets", "metrics")


def changed_fields(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The names of the engine settings whose values differ, in declaration order."""
    return [f.name for f in dataclasses.fields(EngineConfig)
            if getattr(old, f.name) != getattr(new, f.name)]


def restart_fields(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The changed engine settings a running engine cannot take."""
    return [name for name in changed_fields(old, new) if name not in ENGINE_LIVE_KEYS]


def live_config(old: EngineConfig, new: EngineConfig) -> EngineConfig:
    """``old`` with the live settings of ``new``: what the engine runs on after a reload that
    also changed settings needing a restart (those keep their old values)."""
    return dataclasses.replace(old, **{name: getattr(new, name) for name in ENGINE_LIVE_KEYS})


def _sockets_differ_only_in_mode(old, new) -> bool:
    if len(old) != len(new):
        return False
    return all(dataclasses.replace(a, mode=0) == dataclasses.replace(b, mode=0)
               for a, b in zip(old, new))


def daemon_changes(old: DaemonConfig, new: DaemonConfig) -> tuple[list[str], list[str]]:
    """``(live, restart)``: the changed ``[daemon]`` keys, split by whether they apply live."""
    live, restart = [], []
    for f in dataclasses.fields(DaemonConfig):
        if getattr(old, f.name) == getattr(new, f.name):
            continue
        if f.name in DAEMON_LIVE_KEYS and (
                f.name != "sockets" or _sockets_differ_only_in_mode(old.sockets, new.sockets)):
            live.append(f.name)
        else:
            restart.append(f.name)
    return live, restart
