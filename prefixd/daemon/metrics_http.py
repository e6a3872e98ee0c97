"""The Prometheus endpoint: ``GET /metrics`` on a loopback port or a Unix socket.

The HTTP server runs on its own thread; the engine is single-threaded and owned by the event
loop, so a scrape never reads it from there. Each scrape asks the loop for a fresh
``metrics.snapshot`` (``call_soon_threadsafe``) and waits at most ``SCRAPE_WAIT_S``; when the
loop does not answer in time (a long checkpoint, a hung call) the scrape serves the last
snapshot and counts a stale scrape (``prefixd_metrics_stale_scrapes_total``), so Prometheus
still sees the daemon and the watchdog, not the scrape, decides about a stuck loop.

NOTE: a snapshot per scrape, not one refreshed by the tick task: an idle endpoint costs
nothing, and a scrape's numbers are as of the scrape.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.server
import logging
import os
import socket
import socketserver
import stat
import threading
import time

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from prefixd.daemon import metrics
from prefixd.config.daemon_settings import MetricsConfig

log = logging.getLogger(__name__)

SCRAPE_WAIT_S = 2.0


class _Collector:
    """Renders the loop's latest snapshot as prometheus_client families (called on the HTTP
    thread by ``generate_latest``)."""

    def __init__(self, exporter: "MetricsExporter") -> None:
        self.exporter = exporter

    def collect(self):
        families, stale = self.exporter.families()
        for fam in families:
            names = [k for k in (fam.samples[0][0] if fam.samples else {})]
            if fam.kind == "counter":
                out = CounterMetricFamily(fam.name, fam.help, labels=names)
                for labels, value in fam.samples:
                    out.add_metric([labels[k] for k in names], value)
            elif fam.kind == "gauge":
                out = GaugeMetricFamily(fam.name, fam.help, labels=names)
                for labels, value in fam.samples:
                    out.add_metric([labels[k] for k in names], value)
            else:
                out = HistogramMetricFamily(fam.name, fam.help, labels=names)
                for labels, hist in fam.samples:
                    buckets, cumulative = [], 0
                    for bound, n in zip((*hist.bounds, float("inf")), hist.counts):
                        cumulative += n
                        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                                        cumulative))
                    out.add_metric([labels[k] for k in names], buckets, hist.total)
            yield out
        out = CounterMetricFamily("prefixd_metrics_stale_scrapes", "scrapes served an old "
                                  "snapshot because the event loop did not answer in time")
        out.add_metric([], stale)
        yield out


class _Handler(http.server.BaseHTTPRequestHandler):
    registry: CollectorRegistry  # set on the subclass the exporter makes

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404, "the metrics are at /metrics")
            return
        try:
            body = generate_latest(self.registry)
        except Exception:  # noqa: BLE001 - a scrape must not kill the thread
            log.exception("metrics scrape failed")
            self.send_error(500, "scrape failed: see the daemon's log")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 - scrapes are not logged
        pass


class _TcpServer(http.server.ThreadingHTTPServer):
    daemon_threads = True


class _Tcp6Server(_TcpServer):
    address_family = socket.AF_INET6


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        conn, _ = super().get_request()
        return conn, ("unix", 0)  # BaseHTTPRequestHandler expects a (host, port) pair


class MetricsExporter:
    """The endpoint of one daemon: ``start(config)``, ``reconfigure(config)``, ``stop()``.

    Invariants: at most one server runs; ``_families`` is the last snapshot the loop made
    (replaced whole, so the HTTP thread never sees one half-built).
    """

    def __init__(self, core, loop: asyncio.AbstractEventLoop) -> None:
        self.core = core
        self.loop = loop
        self.listen = ""
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None
        self._families: list = []
        self._stale = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)

    # -- scraping (HTTP thread) ----------------------------------------------------------------

    def families(self) -> tuple[list, int]:
        """A snapshot made on the loop now, or the last one when the loop is busy."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def build() -> None:
            try:
                done.set_result(metrics.snapshot(self.core))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(build)
            self._families = done.result(timeout=SCRAPE_WAIT_S)
        except concurrent.futures.TimeoutError:
            self._stale += 1
            log.warning("metrics scrape: the event loop did not answer within %.1f s; serving "
                        "the last snapshot", SCRAPE_WAIT_S)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            self._stale += 1
        return self._families, self._stale

    # -- the server (loop thread) --------------------------------------------------------------

    def start(self, config: MetricsConfig) -> None:
        """Listen where ``config`` says (nothing when off).

        Raises OSError: the address cannot be bound (in use, no such directory).
        """
        if not config.listen:
            return
        address = config.address()
        handler = type("Handler", (_Handler,), {"registry": self.registry})
        if isinstance(address, str):
            _clear_stale(address)
            server: socketserver.BaseServer = _UnixServer(address, handler)
            os.chmod(address, 0o660)
        else:
            cls = _Tcp6Server if ":" in address[0] else _TcpServer
            server = cls(address, handler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                  name="prefixd-metrics", daemon=True)
        thread.start()
        self._server, self._thread, self.listen = server, thread, config.listen
        log.info("metrics endpoint listening on %s", config.listen)

    def reconfigure(self, config: MetricsConfig) -> None:
        """Move the endpoint (a live reload). The new address is bound before the old one is
        closed, unless they are the same place; on an error the old one keeps serving.

        Raises OSError: the new address cannot be bound (the old endpoint is kept).
        """
        old_server, old_thread, old_listen = self._server, self._thread, self.listen
        if config.listen == old_listen:
            return
        if config.listen and _same_place(config, old_listen):
            self.stop()
            self.start(config)
            return
        self._server = self._thread = None
        try:
            self.start(config)
        except BaseException:
            self._server, self._thread, self.listen = old_server, old_thread, old_listen
            raise
        if not config.listen:
            self.listen = ""
        _close(old_server, old_thread, old_listen)

    def stop(self) -> None:
        server, thread, listen = self._server, self._thread, self.listen
        self._server = self._thread = None
        self.listen = ""
        _close(server, thread, listen)


def _same_place(config: MetricsConfig, old_listen: str) -> bool:
    if not old_listen:
        return False
    return config.address() == MetricsConfig(old_listen).address()


def _close(server, thread, listen: str) -> None:
    if server is None:
        return
    server.shutdown()
    server.server_close()
    if thread is not None:
        thread.join(timeout=5)
    if listen.startswith("unix:"):
        try:
            os.unlink(listen[5:])
        except FileNotFoundError:
            pass
    log.info("metrics endpoint on %s closed", listen)


def _clear_stale(path: str) -> None:
    """Remove a socket file nobody answers on (left by a killed daemon)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket: remove it or choose another "
                      f"[daemon.metrics] listen path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(f"metrics socket {path} is served by another process: choose another "
                  f"[daemon.metrics] listen path")


def scrape_unix(path: str, timeout: float = 5.0) -> str:
    """``GET /metrics`` over a Unix socket (tests and ``prefixctl``-less debugging)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: prefixd\r\n\r\n")
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.0 200") and not head.startswith(b"HTTP/1.1 200"):
        raise OSError(f"metrics scrape of {path} answered {head.splitlines()[:1]!r}")
    return body.decode()
