"""The daemon process: lock, sockets, recovery, the serving loop, and a clean stop.

Order at start (each step only after the one before succeeded):

1. take the state directory's lock (a second daemon on the same state exits here, naming the
   first one's pid, before it touches any socket);
2. bind one ``grpc.aio`` server per tenant socket (with health checking and reflection) and
   answer Status while
3. the engine opens (recovers) on a worker thread; then health says SERVING and every rpc is
   served, and a tick task runs the engine's periodic work and the lease sweep.

SIGTERM / SIGINT: refuse new calls UNAVAILABLE, end the KeepAlive streams (sessions are not
ended: their sequences stay in the log for a Reclaim after the restart), let the calls in
flight finish and their answers go out (within ``shutdown_grace_s``), remove the sockets,
checkpoint, close the engine, and end the process (exit 0) with the gRPC servers never shut
down: see ``_shutdown``'s NOTE.

Under systemd (``prefixd.daemon.lifecycle``): STATUS= while recovering, READY=1 once every
socket answers, WATCHDOG=1 from the loop, STOPPING=1 at a stop. SIGHUP, or a change to the
config file, reloads it (``prefixd.daemon.reload``: live settings apply, the rest wait for a
restart).
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import grp
import logging
import os
import pwd
import signal
import socket
import stat

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.config.daemon_settings import DaemonConfig, TenantSocket
from prefixd.config.engine_settings import EngineConfig
from prefixd.config.errors import ConfigError
from prefixd.daemon.handlers import GenericOnly, add_service
from prefixd.daemon.collector import freeze_startup_heap
from prefixd.daemon.core import SERVING, STOPPING, DaemonCore
from prefixd.daemon.config_watch import ConfigWatch
from prefixd.daemon.kv_publisher import KVPublishers
from prefixd.daemon.lifecycle import Lifecycle
from prefixd.daemon.metrics_http import MetricsExporter
from prefixd.daemon.reload import ConfigSource, Reloader
from prefixd.daemon.service import PrefixCacheService
from prefixd.engine.durable import TICK_PERIOD_S
from prefixd.engine.engine import Engine
from prefixd.wal import WalNoSpaceError
from prefixd.wal.lock import StateDirLock

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["PrefixCache"].full_name


class SocketInUseError(ConfigError):
    """A socket path is served by another process (not a stale file)."""


class Daemon:
    """One daemon process over ``state_dir``; ``await run()`` serves until a stop signal.

    Invariants: the lock is held before any socket file exists and until every one is removed;
    ``core.engine`` is set only after recovery and used only on the loop's thread.
    """

    def __init__(self, state_dir: str, engine_config: EngineConfig, config: DaemonConfig,
                 source: ConfigSource | None = None, *, end_process: bool = False) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.end_process = end_process  # run() ends the process itself (``_shutdown``'s NOTE)
        self.core = DaemonCore(engine_config, config, self.state_dir)
        # sd_notify (READY, STATUS, WATCHDOG, STOPPING) and the config reload: see lifecycle.py
        self.lifecycle = Lifecycle(self.core)
        self.source = source or ConfigSource(None)
        self.reloader = Reloader(self.core, self.source, self.lifecycle)
        self._watch: ConfigWatch | None = None
        self.sockets = config.socket_paths(engine_config, self.state_dir)
        self._servers: list[tuple[grpc.aio.Server, health.aio.HealthServicer]] = []
        self._bound: list[str] = []
        self._stop = asyncio.Event()

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or ``stop()``); returns the exit status.

        Raises:
            StateLockedError: another daemon holds the state directory (nothing was bound).
            ConfigError, SocketInUseError, OSError: a socket could not be set up (nothing served).
        """
        loop = asyncio.get_running_loop()
        lock = StateDirLock(self.state_dir)  # 1: before any socket
        try:
            self.core.loop_lag.start(loop)  # the loop's lag, a metric from the start
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
            loop.add_signal_handler(signal.SIGHUP, self.reloader.request, "SIGHUP")
            if self.source.path is not None:
                self._watch = ConfigWatch(self.source.path, loop, self.reloader.request)
                self._watch.start()
            self.core.metrics = MetricsExporter(self.core, loop)  # Prometheus: metrics_http.py
            self.core.metrics.start(self.core.config.metrics)
            for sock in self.sockets:  # 2
                await self._serve_socket(sock)
            self.core.kv_publishers = KVPublishers.create(  # routers may connect meanwhile
                self.core.config.kv_events, [t.name for t in self.core.engine_config.tenants])
            log.info("listening sockets=%s state_dir=%s pid=%d", ",".join(self._bound),
                     self.state_dir, os.getpid())
            # 3: the engine recovers off the loop; Status answers meanwhile
            engine_lock, lock = lock, None  # the engine owns (and releases) it from here
            self.lifecycle.recovering()
            self.core.engine = await loop.run_in_executor(
                None, lambda: Engine(self.state_dir, self.core.engine_config, lock=engine_lock,
                                     progress=self.core.progress))
        except BaseException:
            self.lifecycle.stopping()
            self.core.loop_lag.stop()
            self._stop_watch()
            self._stop_metrics()
            await self._close_servers(0)
            self._close_publishers()
            if lock is not None:
                lock.release()
            raise
        await self._listen()  # KV events for routers
        for _, dc in self.core.engine.pool_items():  # checkpoints beside the loop (offloop.py)
            self.core.offloop.watch(dc)
        freeze_startup_heap()  # imports and the recovered index: no full collection walks them again
        self.core.state = SERVING
        for _, health_servicer in self._servers:
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving pools=%d epoch=%#x", len(self.core.engine.pools()), self.core.epoch)
        ticker = asyncio.create_task(self._tick())
        await self.lifecycle.serving(list(self._bound))  # READY=1, then the watchdog loop
        self.reloader.serving()
        await self._stop.wait()
        status = await self._shutdown(ticker)
        if self.end_process:
            # the exit handlers (a profiler's, a wrapper's) and the log's flush run; nothing
            # else of the interpreter's exit does (it would shut the servers down)
            atexit._run_exitfuncs()
            logging.shutdown()
            os._exit(status)
        return status

    async def _listen(self) -> None:
        """Feed the engine's events to the journals (SubscribeEvents) and, when configured,
        the ZMQ publishers: first ``AllBlocksCleared`` and the recovered index there."""
        core = self.core
        journals, pubs = core.events, core.kv_publishers
        if pubs is None:
            core.engine.set_event_listener(journals.observe)
            return
        await pubs.start(core.engine)

        def listener(tenant, layout, events):
            journals.observe(tenant, layout, events)
            pubs.observe(tenant, layout, events)

        core.engine.set_event_listener(listener)

    def _close_publishers(self) -> None:
        if self.core.kv_publishers is not None:
            self.core.kv_publishers.close()
            self.core.kv_publishers = None

    def stop(self) -> None:
        """Begin a clean stop (what SIGTERM does)."""
        if not self._stop.is_set():
            log.info("stop requested")
        self._stop.set()

    # -- serving -------------------------------------------------------------------------------

    async def _serve_socket(self, sock: TenantSocket) -> None:
        cfg = self.core.config
        _prepare_path(sock.path)
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=cfg.max_concurrent_calls)
        add_service(PrefixCacheService(self.core, sock.tenant), server)
        health_servicer = health.aio.HealthServicer()
        generic = GenericOnly(server)  # one pending future per call, not one per method
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, generic)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)), generic)
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            server.add_insecure_port("unix:" + sock.path)
        except RuntimeError as exc:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {sock.path}: {exc}") from None
        await server.start()
        self._servers.append((server, health_servicer))
        self._bound.append(sock.path)
        _set_owner_and_mode(sock)

    async def _tick(self) -> None:
        """The engine's periodic work and the lease sweep, every ``TICK_PERIOD_S``."""
        core = self.core
        while True:
            await asyncio.sleep(TICK_PERIOD_S)
            try:
                core.engine.tick()
            except Exception as exc:  # noqa: BLE001 - logged; the loop keeps serving
                log.error("engine tick failed error=%r", exc)
            try:
                core.sessions.tick()
            except Exception as exc:  # noqa: BLE001
                log.exception("lease sweep failed error=%r", exc)
            if core.state == SERVING:
                core.close_empty_pools()  # logs its own failures

    # -- stopping ------------------------------------------------------------------------------

    async def _shutdown(self, ticker: asyncio.Task) -> int:
        """Stop serving and close the engine; returns the exit status.

        NOTE: the gRPC servers are never shut down. ``grpc.aio``'s ``server.stop`` (gRPC
        core's server shutdown) answers CANCELLED to every call its transport had read but
        not yet handed to a handler, and to every call read before the client saw the GOAWAY;
        on a loaded host some of those are calls a client sent before the SIGTERM, and
        CANCELLED leaves it unable to tell whether its commit happened. Instead every call a
        handler takes from the SIGTERM on is refused UNAVAILABLE (``check_serving``), the
        stop waits until no call is running or unanswered (``_drain``: ``open_calls`` falls
        when a call's status went out), and the process ends with the servers up
        (``end_process``): the kernel closes the connections, and a call never handed to a
        handler fails UNAVAILABLE on its client, as at a crash.
        """
        core = self.core
        core.state = STOPPING
        self.lifecycle.stopping()
        self._stop_watch()
        log.info("stopping sessions=%d in_flight=%d", len(core.sessions), core.in_flight)
        for _, health_servicer in self._servers:
            await health_servicer.enter_graceful_shutdown()
        for task in list(core.keepalive_tasks):  # streams never end by themselves
            task.cancel()
        core.events.close()  # SubscribeEvents streams end UNAVAILABLE, naming where to resume
        await self._drain(core.config.shutdown_grace_s)
        self._unlink_sockets()
        ticker.cancel()
        self._stop_metrics()
        if core.open_calls and not core.in_flight:
            log.warning("answers not sent within shutdown_grace_s=%.1f: their clients see the "
                        "connection close (UNAVAILABLE) calls=%d", core.config.shutdown_grace_s,
                        core.open_calls)
        if core.in_flight:
            # a call still runs on the engine: closing it under the call is not safe, and the
            # log holds everything acknowledged, as after a crash
            log.error("calls still running after shutdown_grace_s=%.1f, stopping without a "
                      "checkpoint (the next start replays the log) in_flight=%d",
                      core.config.shutdown_grace_s, core.in_flight)
            return 1
        # a kernel still running (its call gone) reads the pools: it ends before they close
        await asyncio.get_running_loop().run_in_executor(None, core.compute.shutdown)
        await core.offloop.drain()  # checkpoints the engine started, pools being made
        status = 0
        try:  # beside the loop, which still answers signals and the watchdog
            lsns = await core.offloop.checkpoint_all(core.engine)
            log.info("checkpoint at stop pools=%d", len(lsns))
        except WalNoSpaceError as exc:  # the log is intact: nothing is lost, only replay time
            log.warning("checkpoint at stop not taken: the filesystem is full (the next start "
                        "replays the log) error=%s", exc)
        except Exception as exc:  # noqa: BLE001 - the log still holds everything acknowledged
            log.error("checkpoint at stop failed (the next start replays the log) error=%r", exc)
            status = 1
        core.offloop.close()
        core.loop_lag.stop()
        try:
            core.engine.close()
        except Exception as exc:  # noqa: BLE001
            log.error("closing the engine failed error=%r", exc)
            status = 1
        self._close_publishers()  # the last batch out, the replay thread stopped
        log.info("stopped status=%d", status)
        return status

    def _stop_metrics(self) -> None:
        if self.core.metrics is not None:
            self.core.metrics.stop()

    def _stop_watch(self) -> None:
        self.reloader.cancel()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    async def _drain(self, grace: float) -> None:
        """Wait (at most ``grace`` s) until no call runs in a handler and every answer went
        out. The servers still accept meanwhile: a call arriving is refused UNAVAILABLE by its
        handler (``check_serving``: the state is ``stopping``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while (self.core.in_flight or self.core.open_calls) and loop.time() < deadline:
            await asyncio.sleep(0.005)

    def _unlink_sockets(self) -> None:
        """Remove the socket files: a client connecting from now on finds none (UNAVAILABLE)."""
        for path in self._bound:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    async def _close_servers(self, grace: float) -> None:
        """Shut the servers down (a start that failed: no call was ever served)."""
        await asyncio.gather(*(server.stop(grace) for server, _ in self._servers),
                             return_exceptions=True)
        self._unlink_sockets()
        self._servers.clear()
        self._bound.clear()


def _prepare_path(path: str) -> None:
    """Make the socket's directory (0750 when we create it) and clear a stale socket file.

    Raises SocketInUseError when a process answers on ``path``; ConfigError when ``path`` is
    something other than a socket.
    """
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o750)
        os.chmod(directory, 0o750)  # makedirs' mode is filtered by the umask
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket: remove it or choose another socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left by a daemon that died: nobody listens
        log.info("removed a stale socket path=%s", path)
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise SocketInUseError(f"socket {path} is served by another process (another prefixd on "
                           f"another state directory?): stop it or choose another socket path")


def _set_owner_and_mode(sock: TenantSocket) -> None:
    """Apply the tenant socket's mode, owner and group (owner/group need the privilege)."""
    os.chmod(sock.path, sock.mode)
    uid = _resolve(sock.owner, pwd.getpwnam, "pw_uid", "user")
    gid = _resolve(sock.group, grp.getgrnam, "gr_gid", "group")
    if uid != -1 or gid != -1:
        try:
            os.chown(sock.path, uid, gid)
        except PermissionError:
            raise ConfigError(f"cannot give socket {sock.path} owner {sock.owner!r} group "
                              f"{sock.group!r}: the daemon lacks the privilege (run it as root "
                              f"or drop owner/group from [[daemon.sockets]])") from None


def _resolve(name: str, lookup, field: str, what: str) -> int:
    if not name:
        return -1
    if name.isdigit():
        return int(name)
    try:
        return getattr(lookup(name), field)
    except KeyError:
        raise ConfigError(f"[[daemon.sockets]]: no {what} named {name!r} on this host") from None
