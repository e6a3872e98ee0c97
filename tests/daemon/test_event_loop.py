"""The daemon's event loop choice (``prefixd.daemon.event_loop``)."""

from __future__ import annotations

import asyncio

import pytest

from prefixd.daemon import event_loop
from prefixd.config.errors import ConfigError

uvloop = pytest.importorskip("uvloop")


def test_auto_is_uvloop_when_installed(monkeypatch):
    monkeypatch.delenv(event_loop.ENV, raising=False)
    name, factory = event_loop.loop_factory()
    loop = factory()
    try:
        assert name == "uvloop" and isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_env_keeps_the_stdlib_loop(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    name, factory = event_loop.loop_factory()
    loop = factory()
    try:
        assert name == "asyncio" and not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_unknown_kind_is_a_config_error_before_main_runs():
    called = []

    async def main():
        called.append(1)

    with pytest.raises(ConfigError, match="PREFIXD_EVENT_LOOP must be one of"):
        event_loop.run(main, "tokio")
    assert not called


def test_run_answers_main_on_the_chosen_loop():
    async def main():
        return type(asyncio.get_running_loop())

    assert issubclass(event_loop.run(main, "uvloop"), uvloop.Loop)
    assert not issubclass(event_loop.run(main, "asyncio"), uvloop.Loop)
