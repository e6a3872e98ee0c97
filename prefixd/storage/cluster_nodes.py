"""The cluster tier's view of a Redis Cluster: slot map, one connection per node and thread, node health.

``ClusterLinks.pipeline(groups, purpose)`` sends every node its commands first and reads the
replies after, so the masters work in parallel and a batch costs one round trip to the slowest
node. The batch has one deadline (``timeout_s`` from its start, see ``batch_deadline``) that
every wait of it shares, connects included: a batch never waits longer than that, however many
nodes are silent. A node that fails (refused, reset, silent past the timeout) is marked down for
``retry_after_s``: until then its keys are answered as missing without touching the network, and
the first call after that tries it again (one log line when an outage starts, one when it ends).

NOTE: our own small router over redis-py's ``Connection`` rather than redis-py's
``RedisCluster``: the library retries, backs off and reloads the topology on errors, which can
hold the caller for seconds against a dead node; the serving path needs "miss now" instead. We
keep the parts of the library that matter for speed and correctness (the RESP packer and parser,
``key_slot``) and own only the routing and the failure policy.

NOTE: connections are per thread (``threading.local``), so the engine thread's ``get_run`` and
the write-behind thread's ``put`` never share a socket or a lock on the data path; the slot map is
replaced whole (readers see the old or the new list), and health and counters sit under one lock.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import Sequence

from redis.backoff import NoBackoff
from redis.connection import Connection
from redis.crc import key_slot
from redis.exceptions import (ConnectionError as RedisConnectionError, MovedError, RedisError,
                              ResponseError, TimeoutError as RedisTimeoutError)
from redis.retry import Retry

log = logging.getLogger(__name__)

NUM_SLOTS = 16384

# NOTE: writes run off the serving path and send whole batches (megabytes) in one ``sendall``,
# whose timeout bounds the whole send in Python, so they get a longer one than reads.
PUT_TIMEOUT_FLOOR_S = 0.5

READ_SIZE = 1 << 20

# NOTE: what a node is still given once the batch's deadline has passed (an earlier node used
# it up): enough to read a reply that is already in the socket's buffer, so one silent node does
# not turn the answers of the others into misses, and small enough that N nodes add N ms.
MIN_WAIT_S = 0.001


class NodeFailure(Exception):
    """A node could not be used for this batch; ``timeout`` says whether it went silent."""

    def __init__(self, node: str, cause: BaseException, timeout: bool) -> None:
        super().__init__(f"{node}: {cause}")
        self.node, self.cause, self.timeout = node, cause, timeout


def _drop_if_stale(conn: Connection) -> None:
    """Disconnect ``conn`` if its peer closed it while it sat idle, so the next send reconnects.

    NOTE: found by part B's kill/restart test: a node's restart is noticed by the thread that
    used it first; every other thread's idle connection to it was closed by the dead process and
    would fail once more on its next use, opening a new outage (and a log line, and
    ``retry_after_s`` of misses) per thread. An idle connection with no request in flight is
    readable only when the peer closed it (or sent garbage), so one ``select`` per node and
    batch finds it; redis-py's own pool makes the same check (``can_read``) before a reuse.
    """
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        readable = [sock]
    if readable:
        conn.disconnect()


class ClusterLinks:
    """Routing and health for one Redis Cluster.

    Invariants: ``_slots`` is None or a list of NUM_SLOTS node names; a node is in ``_down_until``
    only while an outage of it is open (logged once at its start); ``_conns`` holds every
    connection any thread made, so ``close`` reaches them all.
    """

    def __init__(self, nodes: Sequence[str], *, timeout_s: float, connect_timeout_s: float,
                 retry_after_s: float) -> None:
        if not nodes:
            raise ValueError("give at least one cluster node as 'host:port'")
        for n in nodes:
            host, sep, port = n.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"cluster node {n!r} is not 'host:port'")
        self.startup = list(nodes)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._local = threading.local()
        self._conns: list[Connection] = []
        self._slots: list[str] | None = None
        self._slots_stale = True
        self._map_retry_at = 0.0
        self._map_out = False
        self._down_until: dict[str, float] = {}
        self._closed = False

    # -- health -------------------------------------------------------------------------------

    def is_down(self, node: str, now: float) -> bool:
        until = self._down_until.get(node)
        return until is not None and now < until

    def mark_down(self, node: str, cause: BaseException) -> None:
        with self._lock:
            opened = node not in self._down_until
            self._down_until[node] = time.monotonic() + self.retry_after_s
        self._drop_connections(node)
        if opened:
            log.warning("cluster node down node=%s retry_after_s=%s cause=%s; its blocks are misses "
                        "until it answers again", node, self.retry_after_s, cause)

    def mark_up(self, node: str) -> None:
        if node not in self._down_until:
            return
        with self._lock:
            closed = self._down_until.pop(node, None) is not None
        if closed:
            log.warning("cluster node back node=%s", node)

    def mark_stale(self) -> None:
        """A MOVED reply or an unknown slot: reload the slot map before the next batch."""
        self._slots_stale = True

    # -- slot map -----------------------------------------------------------------------------

    def nodes_of(self, keys: Sequence[bytes], deadline: float | None = None) -> list[str] | None:
        """The master of each key, or None when no slot map can be had (the cluster is out).

        ``deadline``: the batch's (``batch_deadline``), when reloading the slot map is part of
        one (default: one of its own)."""
        if self._slots_stale or self._slots is None:
            self._refresh(self.batch_deadline("get") if deadline is None else deadline)
        slots = self._slots
        if slots is None:
            return None
        return [slots[key_slot(k)] for k in keys]

    def _refresh(self, deadline: float) -> None:
        """Reload the slot map from the first known node that answers, all by ``deadline``."""
        now = time.monotonic()
        if now < self._map_retry_at:
            return
        known = list(dict.fromkeys(self.startup + sorted(set(self._slots or ()) - {""})))
        last: BaseException | None = None
        for node in known:
            if self.is_down(node, now):
                continue
            try:
                reply = self._call(node, "get", ("CLUSTER", "SLOTS"), deadline)
            except NodeFailure as e:
                last = e
                self.mark_down(node, e.cause)
                continue
            slots = None if isinstance(reply, ResponseError) else self._parse_slots(reply, node)
            if slots is not None:
                self._slots, self._slots_stale = slots, False
                if self._map_out:
                    self._map_out = False
                    log.warning("cluster reachable again via node=%s", node)
                return
        self._map_retry_at = now + self.retry_after_s
        if not self._map_out and self._slots is None:
            self._map_out = True
            log.warning("cluster unreachable nodes=%s retry_after_s=%s last_error=%s; serving local only",
                        known, self.retry_after_s, last)

    @staticmethod
    def _parse_slots(reply, asked: str) -> list[str] | None:
        slots: list[str | None] = [None] * NUM_SLOTS
        for entry in reply or ():
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            name = f"{host or asked.rpartition(':')[0]}:{int(master[1])}"
            slots[start:end + 1] = [name] * (end - start + 1)
        if any(s is None for s in slots):
            # NOTE: a partly covered map is kept: an uncovered slot's keys are misses.
            if all(s is None for s in slots):
                return None
            return [s or "" for s in slots]
        return slots  # type: ignore[return-value]

    # -- the wire -----------------------------------------------------------------------------

    def batch_deadline(self, purpose: str) -> float:
        """The ``time.monotonic()`` by which a batch started now must be over: ``timeout_s``
        for reads, at least ``PUT_TIMEOUT_FLOOR_S`` for writes."""
        return time.monotonic() + self._timeout(purpose)

    def _timeout(self, purpose: str) -> float:
        return self.timeout_s if purpose == "get" else max(self.timeout_s, PUT_TIMEOUT_FLOOR_S)

    def _budget(self, conn: Connection, deadline: float) -> None:
        """Bound ``conn``'s next connect, send or read by what is left until ``deadline``.

        NOTE: the socket's timeout bounds each wait, not a batch; set from the deadline before
        every wait, the waits of one batch add up to at most its deadline (plus ``MIN_WAIT_S``
        per node once it has passed), where a fresh timeout per node would make N frozen
        masters cost N timeouts, in turn. A reply that trickles in is bounded per wait.
        """
        left = max(deadline - time.monotonic(), MIN_WAIT_S)
        conn.socket_timeout = left
        conn.socket_connect_timeout = min(self.connect_timeout_s, left)
        conn.update_current_socket_timeout(left)  # a connected socket (and its parser) now

    def _connection(self, node: str, purpose: str) -> Connection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get((node, purpose))
        if conn is None:
            host, _, port = node.rpartition(":")
            timeout = self._timeout(purpose)  # replaced per wait by ``_budget``
            conn = Connection(host=host, port=int(port), socket_timeout=timeout,
                              socket_connect_timeout=self.connect_timeout_s,
                              retry=Retry(NoBackoff(), 0), driver_info=None,
                              socket_read_size=READ_SIZE)
            conns[(node, purpose)] = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _drop_connections(self, node: str) -> None:
        conns = getattr(self._local, "conns", None) or {}
        for (n, _), conn in conns.items():
            if n == node:
                conn.disconnect()

    def _call(self, node: str, purpose: str, command: tuple, deadline: float | None = None):
        """One command to one node; its reply (an error reply as a ``ResponseError``).

        Raises:
            NodeFailure: the node could not be used.
        """
        replies = self.pipeline({node: [command]}, purpose, deadline)[node]
        if isinstance(replies, NodeFailure):
            raise replies
        return replies[0]

    def pipeline(self, groups: dict[str, list[tuple]], purpose: str,
                 deadline: float | None = None) -> dict[str, list]:
        """Send each node its commands, then read every reply, all by one deadline.

        Args:
            deadline: ``time.monotonic()`` by which every connect, send and read of the batch
                is over (default: ``batch_deadline(purpose)`` from now). A node not done by then
                is a ``NodeFailure`` with ``timeout`` set.

        Returns per node either the list of replies (a ``ResponseError`` instance in place of an
        error reply, e.g. OOM or MOVED) or a ``NodeFailure`` when the node could not be used; the
        caller marks the node down. Never raises for a cluster failure.
        """
        if self._closed:
            return {n: NodeFailure(n, RuntimeError("store closed"), False) for n in groups}  # type: ignore[misc]
        if deadline is None:
            deadline = self.batch_deadline(purpose)
        out: dict[str, list | NodeFailure] = {}
        sent: list[str] = []
        for node, commands in groups.items():
            conn = self._connection(node, purpose)
            _drop_if_stale(conn)
            try:
                self._budget(conn, deadline)  # a connect, if it needs one, and the send
                conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                sent.append(node)
            except (RedisError, OSError) as e:
                conn.disconnect()
                out[node] = NodeFailure(node, e, isinstance(e, RedisTimeoutError))
        for node in sent:
            conn = self._connection(node, purpose)
            replies: list = []
            try:
                for _ in groups[node]:
                    try:
                        self._budget(conn, deadline)
                        replies.append(conn.read_response())
                    except ResponseError as e:
                        if isinstance(e, MovedError):
                            self.mark_stale()
                        replies.append(e)
                out[node] = replies
            except (RedisConnectionError, RedisTimeoutError, RedisError, OSError) as e:
                conn.disconnect()
                out[node] = NodeFailure(node, e, isinstance(e, RedisTimeoutError))
        return out  # type: ignore[return-value]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.disconnect()

    def check_invariants(self) -> None:
        slots = self._slots
        assert slots is None or len(slots) == NUM_SLOTS, "slot map of the wrong size"
        assert all(isinstance(t, float) for t in self._down_until.values()), "bad down_until"
