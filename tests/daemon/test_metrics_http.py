"""The metrics endpoint without a daemon: it serves a snapshot made on the loop, moves live
(the new address first, the old one kept when the new cannot be bound), and serves the last
snapshot when the loop does not answer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixd.daemon import metrics_http
from prefixd.daemon.core import DaemonCore
from prefixd.daemon.metrics_http import MetricsExporter, scrape_unix
from prefixd.config.daemon_settings import DaemonConfig, MetricsConfig
from prefixd.config.engine_settings import EngineConfig


@pytest.fixture
def exporter(tmp_path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    core = DaemonCore(EngineConfig(), DaemonConfig(), str(tmp_path))
    exp = MetricsExporter(core, loop)
    yield exp
    exp.stop()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def test_endpoint_serves_while_recovering_and_moves_live(exporter, tmp_path):
    a, b = tmp_path / "a.sock", tmp_path / "b.sock"
    exporter.start(MetricsConfig(f"unix:{a}"))
    first = scrape_unix(str(a))
    assert {"prefixd_up", "prefixd_state", "prefixd_recovery_records_replayed"} <= names(first)
    assert 'prefixd_state{state="recovering"} 1.0' in first
    exporter.reconfigure(MetricsConfig(f"unix:{b}"))
    assert "prefixd_up" in names(scrape_unix(str(b)))
    assert not a.exists(), "the old socket stays after a move"
    with pytest.raises(OSError):
        exporter.reconfigure(MetricsConfig(f"unix:{tmp_path}/no/such/dir/c.sock"))
    assert "prefixd_up" in names(scrape_unix(str(b))), "a failed move closed the old endpoint"
    exporter.reconfigure(MetricsConfig(""))
    assert not b.exists() and exporter.listen == ""


def test_scrape_serves_the_last_snapshot_when_the_loop_is_busy(exporter, tmp_path, monkeypatch):
    """Guards against a scrape that hangs (or reads the engine from its own thread) while the
    loop is blocked: it waits ``SCRAPE_WAIT_S`` and serves the previous snapshot, counted."""
    monkeypatch.setattr(metrics_http, "SCRAPE_WAIT_S", 0.3)
    path = tmp_path / "m.sock"
    exporter.start(MetricsConfig(f"unix:{path}"))
    assert "prefixd_up" in names(scrape_unix(str(path)))
    exporter.loop.call_soon_threadsafe(time.sleep, 1.5)  # the loop is blocked
    stale = scrape_unix(str(path))
    assert "prefixd_up" in names(stale)
    assert "prefixd_metrics_stale_scrapes_total 1.0" in stale
