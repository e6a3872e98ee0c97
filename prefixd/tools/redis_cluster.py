"""A throwaway Redis Cluster on loopback ports, for tests, benchmarks and demos of the cluster tier.

``RedisCluster(nodes=3)`` starts ``nodes`` masters (no replicas) of the system's ``redis-server``
in a temporary directory, joins them with ``redis-cli --cluster create`` and waits until every
node reports ``cluster_state:ok``. ``kill(i)`` SIGKILLs one node (its keys are gone: the nodes
keep nothing on disk but ``nodes.conf``), ``restart(i)`` starts it again on the same port with
the same ``nodes.conf`` (same node id, same slots), ``stop()`` ends all of them and removes the
directory. Use it as a context manager.

NOTE: the nodes run with ``cluster-require-full-coverage no`` and a short
``cluster-node-timeout``: for a cache, the surviving masters should keep serving their slots
while one is down (the default would refuse every key on every node once the dead one is marked
failed), and the tests should not wait the default 15 s for the cluster to notice. That is also
what we recommend in production for the cache tier (docs/scale-out.md).

NOTE: Redis Cluster's bus port is the client port + 10000, so a port is taken only when both
are free; two processes can still race for the same pair, so a node that fails to bind is
retried on another pair (``_start_node``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SERVER = "redis-server"
CLI = "redis-cli"
BUS_OFFSET = 10000
NODE_TIMEOUT_MS = 1000
START_TIMEOUT_S = 20.0


class RedisClusterError(RuntimeError):
    """The test cluster could not be started or did not become healthy; the message says why."""


def server_missing_reason() -> str | None:
    """Why a cluster cannot be started here (no ``redis-server`` or ``redis-cli``), or None."""
    for binary in (SERVER, CLI):
        if shutil.which(binary) is None:
            return f"{binary} is not on PATH (apt-get install redis-server)"
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port_pair(taken: set[int]) -> int:
    """A port P with P and P + 10000 free on loopback (P below 55536)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + BUS_OFFSET >= 65536 or port in taken:
            continue
        if _port_free(port + BUS_OFFSET):
            return port
    raise RedisClusterError("found no free loopback port pair (P, P+10000) in 200 tries")


def _ask(port: int, *args: str, timeout_s: float = 2.0) -> str | None:
    """One command through a fresh connection; the reply as text, or None if the node does not answer."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            parts = [a.encode() for a in args]
            s.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
            reply = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
                if reply.startswith((b"+", b"-", b":")) and reply.endswith(b"\r\n"):
                    break
                if reply.startswith(b"$"):
                    head, _, body = reply.partition(b"\r\n")
                    if len(body) >= int(head[1:]) + 2:
                        break
            return reply.decode(errors="replace")
    except OSError:
        return None


class RedisCluster:
    """``nodes`` Redis masters on loopback forming one cluster; started on construction.

    Attributes:
        nodes: ``"127.0.0.1:P"`` for each node, in index order (the index ``kill`` takes).
        ports: the client ports, same order.
        directory: where each node keeps ``nodes.conf`` and ``redis.log`` (``node<i>/``).

    Invariants: ``_procs[i]`` is None exactly while node i is killed or stopped; a port never
    changes once the cluster is created (``nodes.conf`` of the others name it).
    """

    def __init__(self, nodes: int = 3, *, maxmemory: str = "256mb",
                 maxmemory_policy: str = "allkeys-lru", base_dir: str | None = None) -> None:
        if nodes < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got nodes={nodes}")
        reason = server_missing_reason()
        if reason is not None:
            raise RedisClusterError(reason)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.directory = Path(tempfile.mkdtemp(prefix="prefixd-redis-", dir=base_dir))
        self.ports: list[int] = []
        self._procs: list[subprocess.Popen | None] = []
        try:
            for i in range(nodes):
                port, proc = self._start_node(i, None)
                self.ports.append(port)
                self._procs.append(proc)
            self._create()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        log.info("redis cluster up nodes=%s dir=%s", self.nodes, self.directory)

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> "RedisCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- one node -----------------------------------------------------------------------------

    def _command(self, i: int, port: int) -> list[str]:
        d = self.directory / f"node{i}"
        return [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.maxmemory_policy,
                "--logfile", str(d / "redis.log"), "--daemonize", "no"]

    def _start_node(self, i: int, port: int | None) -> tuple[int, subprocess.Popen]:
        """Start node i on ``port`` (or a fresh free pair, retried on a bind race); wait for PING."""
        (self.directory / f"node{i}").mkdir(exist_ok=True)
        tries = 1 if port is not None else 5
        for _ in range(tries):
            p = port if port is not None else _free_port_pair(set(self.ports))
            proc = subprocess.Popen(self._command(i, p), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and proc.poll() is None:
                if _ask(p, "PING", timeout_s=0.5) == "+PONG\r\n":
                    return p, proc
                time.sleep(0.02)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        tail = (self.directory / f"node{i}" / "redis.log").read_text(errors="replace")[-800:] \
            if (self.directory / f"node{i}" / "redis.log").exists() else "(no log)"
        raise RedisClusterError(f"redis node {i} did not start (port {port}); log tail:\n{tail}")

    def kill(self, i: int) -> None:
        """SIGKILL node i (no shutdown, no save): its keys are lost, like a crashed host."""
        proc = self._procs[i]
        if proc is None:
            raise ValueError(f"node {i} is not running")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self._procs[i] = None
        log.info("redis node killed i=%s port=%s", i, self.ports[i])

    def restart(self, i: int, *, wait: bool = True) -> None:
        """Start killed node i again on its port with its ``nodes.conf``.

        Args:
            wait: wait for ``cluster_state:ok`` on every running node. Pass False while starting
                a majority of killed nodes one by one (a lone master never reports ok).
        """
        if self._procs[i] is not None:
            raise ValueError(f"node {i} is running; kill it first")
        _, self._procs[i] = self._start_node(i, self.ports[i])
        if wait:
            self.wait_ok()
        log.info("redis node restarted i=%s port=%s", i, self.ports[i])

    def pause(self, i: int) -> None:
        """SIGSTOP node i: it accepts connections but answers nothing (a hung or swapping host)."""
        proc = self._procs[i]
        if proc is None:
            raise ValueError(f"node {i} is not running")
        os.kill(proc.pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT node i after ``pause``."""
        proc = self._procs[i]
        if proc is None:
            raise ValueError(f"node {i} is not running")
        os.kill(proc.pid, signal.SIGCONT)

    def alive(self, i: int) -> bool:
        return self._procs[i] is not None

    # -- the cluster --------------------------------------------------------------------------

    def _create(self) -> None:
        out = subprocess.run([CLI, "--cluster", "create", *self.nodes, "--cluster-replicas", "0",
                              "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RedisClusterError(f"redis-cli --cluster create failed ({out.returncode}): "
                                    f"{out.stdout[-800:]} {out.stderr[-800:]}")

    def wait_ok(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and knows every slot."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            infos = [_ask(p, "CLUSTER", "INFO") or "" for i, p in enumerate(self.ports) if self.alive(i)]
            if all("cluster_state:ok" in s and "cluster_slots_ok:16384" in s for s in infos):
                return
            last = next((s for s in infos if "cluster_state:ok" not in s), last)
            time.sleep(0.05)
        raise RedisClusterError(f"cluster not ok after {timeout_s:.0f} s; a node says: {last[:400]}")

    def config_set(self, name: str, value: str) -> None:
        """``CONFIG SET name value`` on every running node (e.g. maxmemory-policy for an OOM test)."""
        for i, p in enumerate(self.ports):
            if self.alive(i):
                reply = _ask(p, "CONFIG", "SET", name, value)
                if reply != "+OK\r\n":
                    raise RedisClusterError(f"CONFIG SET {name} {value} on node {i}: {reply!r}")

    def stop(self) -> None:
        """End every node (SIGKILL: nothing to save) and remove the directory. Idempotent."""
        for i, proc in enumerate(self._procs):
            if proc is not None:
                proc.kill()
                proc.wait()
                self._procs[i] = None
        shutil.rmtree(self.directory, ignore_errors=True)
