"""Reloading the config file while serving: what may change live, and applying it whole.

A reload (the file changed on disk, ``prefixd.daemon.config_watch``, or SIGHUP) reads the
whole file again through ``ConfigSource`` (the same overrides as at start, so ``--socket`` is
not taken for a change) and compares it with what the daemon runs on:

- a file that does not load (bad TOML, a wrong type, an unknown key, a bad value) is refused
  with one error line, and nothing of it is applied;
- settings that are safe to change live (``prefixd.config.live_keys``) are applied, each named
  in one log line with its old and new value: ``[engine]`` eviction, write_policy,
  checkpoint_records, checkpoint_blocks (``prefixd.engine.live_settings``), ``[daemon]``
  log_level, lease_s, shutdown_grace_s, ``[daemon.limits]``, ``[daemon.metrics]``, and the
  ``mode`` of ``[[daemon.sockets]]``;
- every other change (pool sizes, state and shm dirs, sync, tenants, socket paths and owners,
  message sizes, ...) is refused with a warning that names the settings and says a restart
  applies them; the daemon keeps the running values of those.

NOTE: a valid file that changes both kinds applies the live ones and keeps the others: the
file is what the next start will use, and refusing the live part would leave an operator
who edited a pool size for the next restart unable to change the log level meanwhile. A file
that does not load is different: it says nothing reliable, so nothing of it is used.

``DAEMON_LIVE`` maps each live ``[daemon]`` key (``live_keys.DAEMON_LIVE_KEYS``) to the function
that applies it; a part that adds a daemon setting it can apply live adds its key to
``DAEMON_LIVE_KEYS`` and its applier here (tests/daemon/test_reload.py checks they match).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Callable, NamedTuple

from prefixd.daemon.core import SERVING, DaemonCore
from prefixd.daemon.logs import setup_logging
from prefixd.config.daemon_settings import DaemonConfig
from prefixd.config.engine_settings import EngineConfig
from prefixd.config.errors import ConfigError
from prefixd.config.live_keys import changed_fields, daemon_changes, live_config, restart_fields
from prefixd.config.toml_reader import load
from prefixd.engine import live_settings

log = logging.getLogger(__name__)

DEBOUNCE_S = 0.2  # an editor's save is several file events; reload once they settle


class ConfigSource:
    """The config file and the command line's overrides of it (``--socket``).

    ``path`` None: the defaults, and nothing to reload.
    """

    def __init__(self, path: str | None, socket: str | None = None) -> None:
        self.path = os.path.abspath(path) if path else None
        self.socket = os.path.abspath(socket) if socket else None

    def load(self) -> tuple[EngineConfig, DaemonConfig]:
        """Raises ConfigError (see ``prefixd.config.toml_reader.load``)."""
        engine, daemon = load(self.path)
        if self.socket:
            daemon = dataclasses.replace(daemon, socket=self.socket)
        return engine, daemon


class ReloadOutcome(NamedTuple):
    """What one reload did: the settings applied, the ones kept for a restart, or the reason
    the file was refused (``error``; then nothing was applied)."""

    applied: list[str]
    restart: list[str]
    error: str | None = None

    def summary(self) -> str:
        if self.error is not None:
            return "refused (the file does not load)"
        parts = [f"applied {','.join(self.applied) or 'nothing'}"]
        if self.restart:
            parts.append(f"restart needed for {','.join(self.restart)}")
        return "; ".join(parts)


def _set_lease(core: DaemonCore, old, new) -> None:
    core.sessions.lease_s = float(new)


def _set_limits(core: DaemonCore, old, new) -> None:
    core.sessions.limits = new


def _set_log_level(core: DaemonCore, old, new) -> None:
    setup_logging(new)


def _set_nothing(core: DaemonCore, old, new) -> None:
    """A setting read where it is used (``core.config``), nothing to push."""


def _set_metrics(core: DaemonCore, old, new) -> None:
    """Move the Prometheus endpoint (OSError: the new address cannot be bound; the old stays)."""
    if core.metrics is not None:
        core.metrics.reconfigure(new)


def _set_socket_modes(core: DaemonCore, old, new) -> None:
    for before, after in zip(old, new):
        if before.mode != after.mode and os.path.exists(after.path):
            os.chmod(after.path, after.mode)


# [daemon] key -> apply(core, old value, new value); runs on the loop after every check passed
DAEMON_LIVE: dict[str, Callable] = {
    "log_level": _set_log_level,
    "lease_s": _set_lease,
    "shutdown_grace_s": _set_nothing,
    "limits": _set_limits,
    "sockets": _set_socket_modes,
    "metrics": _set_metrics,
}


def _show(value) -> str:
    if isinstance(value, tuple) and value and hasattr(value[0], "mode"):
        return "[" + ",".join(f"{s.tenant}:{s.mode:04o}" for s in value) + "]"
    return repr(value)


def reload_config(core: DaemonCore, source: ConfigSource) -> ReloadOutcome:
    """Read the file again and apply what may change live (on the loop's thread, serving).

    Never raises for a bad file or a setting that needs a restart: both are logged and
    reported in the outcome; the daemon keeps running on its current values.
    """
    try:
        new_engine, new_daemon = source.load()
    except ConfigError as exc:
        log.error("config reload refused, nothing applied, the daemon keeps its running "
                  "settings: %s", exc)
        return ReloadOutcome([], [], str(exc))
    old_engine, old_daemon = core.engine_config, core.config
    engine_restart = restart_fields(old_engine, new_engine)
    daemon_live, daemon_restart = daemon_changes(old_daemon, new_daemon)
    restart = [f"engine.{k}" for k in engine_restart] + [f"daemon.{k}" for k in daemon_restart]
    if restart:
        log.warning("config reload: %s changed and need a restart to apply (systemctl restart "
                    "prefixd); the daemon keeps their running values", ", ".join(restart))
    applied = []
    engine_target = live_config(old_engine, new_engine)
    for key in changed_fields(old_engine, engine_target):
        log.info("config reload: engine.%s %s -> %s", key, _show(getattr(old_engine, key)),
                 _show(getattr(engine_target, key)))
        applied.append(f"engine.{key}")
    if core.engine is not None:
        live_settings.apply_live(core.engine, engine_target)
    core.engine_config = engine_target
    for key in daemon_live:
        before, after = getattr(old_daemon, key), getattr(new_daemon, key)
        # logged first: a new log_level may hide an info line logged after it
        log.info("config reload: daemon.%s %s -> %s", key, _show(before), _show(after))
        try:
            DAEMON_LIVE[key](core, before, after)
        except OSError as exc:
            log.error("config reload: daemon.%s could not be applied, kept %s error=%r", key,
                      _show(before), exc)
            continue
        core.config = dataclasses.replace(core.config, **{key: after})
        applied.append(f"daemon.{key}")
    if not applied and not restart:
        log.info("config reload: no change")
    return ReloadOutcome(applied, restart)


class Reloader:
    """Runs reloads on the event loop, one at a time, only while serving.

    ``request`` is called on the loop (SIGHUP's handler, the file watch through
    ``call_soon_threadsafe``); requests within ``DEBOUNCE_S`` of each other make one reload.
    A request while recovering waits until ``serving`` (the engine's settings cannot be
    applied to an engine that is not open yet).

    Invariants: at most one reload is scheduled at a time; ``outcomes`` lists every reload
    that ran, in order.
    """

    def __init__(self, core: DaemonCore, source: ConfigSource, lifecycle=None) -> None:
        self.core = core
        self.source = source
        self.lifecycle = lifecycle
        self.outcomes: list[ReloadOutcome] = []
        self._handle: asyncio.TimerHandle | None = None
        self._deferred: str | None = None

    def request(self, reason: str) -> None:
        if self.source.path is None:
            log.info("reload asked (%s) but the daemon runs without a config file: nothing "
                     "to reload", reason)
            return
        if self.core.state != SERVING:
            if self._deferred is None:
                log.info("reload asked (%s) while %s: it runs once serving", reason,
                         self.core.state)
            self._deferred = reason
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = asyncio.get_running_loop().call_later(DEBOUNCE_S, self._run, reason)

    def serving(self) -> None:
        """The daemon serves: run a reload asked for meanwhile."""
        if self._deferred is not None:
            reason, self._deferred = self._deferred, None
            self.request(reason)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._deferred = None

    def _run(self, reason: str) -> None:
        self._handle = None
        if self.core.state != SERVING:
            return
        log.info("config reload (%s) path=%s", reason, self.source.path)
        if self.lifecycle is not None:
            self.lifecycle.reloading()
        outcome = ReloadOutcome([], [], "internal error")
        try:
            outcome = reload_config(self.core, self.source)
        except Exception as exc:  # noqa: BLE001 - a reload must not take the daemon down
            log.exception("config reload failed error=%r", exc)
        finally:
            self.outcomes.append(outcome)
            if self.lifecycle is not None:
                self.lifecycle.reloaded(outcome.summary())
