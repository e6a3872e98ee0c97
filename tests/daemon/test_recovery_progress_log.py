"""Recovery progress reaches the log (journald), not only systemd's STATUS=: an operator
reading ``journalctl -u prefixd`` during a long recovery sees it move."""

from __future__ import annotations

import asyncio
import logging

from prefixd.daemon import lifecycle
from prefixd.daemon.core import SERVING, DaemonCore
from prefixd.config.daemon_settings import DaemonConfig
from prefixd.config.engine_settings import EngineConfig


def test_recovery_progress_is_logged_without_a_notify_socket(tmp_path, monkeypatch, caplog):
    """Guards against progress shown only on STATUS= (no NOTIFY_SOCKET: nothing at all)."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setattr(lifecycle, "STATUS_PERIOD_S", 0.01)
    monkeypatch.setattr(lifecycle, "PROGRESS_LOG_S", 0.0)
    core = DaemonCore(EngineConfig(), DaemonConfig(), str(tmp_path))

    async def recover() -> None:
        life = lifecycle.Lifecycle(core)
        life.recovering()
        core.progress.begin(1000)
        for _ in range(5):
            core.progress.replayed += 200
            await asyncio.sleep(0.03)
        core.state = SERVING
        await asyncio.sleep(0.03)

    with caplog.at_level(logging.INFO, logger="prefixd.daemon.lifecycle"):
        asyncio.run(recover())
    lines = [r.getMessage() for r in caplog.records if "recovery progress" in r.getMessage()]
    assert any("replayed 1000 of 1000 log records (100%)" in line for line in lines), lines
    assert len(lines) >= 3
