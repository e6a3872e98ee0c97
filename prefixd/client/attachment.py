"""The attachment under a ``Session``: channel, Attach / Detach, the lease, and recovery after a
daemon restart (the semantics are in ``prefixd.client.session``'s docstring).

NOTE: ``_call`` is the one place a call meets a lost session: it recovers (at most once per
failure, under the lock), then retries a call that is safe to repeat or raises ``DaemonRestarted``. Every
request is built inside the callable it is given, so a retry reads the new session id and the
handles' new ids.
"""

from __future__ import annotations

import logging
import os
import threading

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.client.breaker import Breaker
from prefixd.client.connection import Connection
from prefixd.client.errors import (DaemonRestarted, DeadlineExceeded, InvalidArgument, NotFound, PrefixdError,
                                   Unavailable, from_rpc_error)
from prefixd.client.handles import Sequence
from prefixd.client.keepalive import KeepAlive
from prefixd.client.mapped import MappedPool
from prefixd.client.reconnect import Backoff, apply_reclaim, reclaim_sessions, unknown_reclaimed

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class Attachment:
    """One client's attachment: session id, lease, pool mappings, live sequences, recovery.

    A ``Session`` (session.py) holds one and adds the API calls; this class owns the
    session's state and holds the ``Connection`` (connection.py) it reaches the daemon by.

    Data structure:
        ``_conn``: the channel, Attach and pool mapping; ``_stub`` is its stub.
        ``id``/``epoch``/``tenant``/``lease_s``/``max_message_bytes``: from the last Attach.
        ``_live``: id -> ``Sequence`` for every handle opened, forked or reclaimed and not yet
        released (what a recovery updates). ``pool``: the mapped device pool, or None (rpcs).
        ``_generation``: bumped by each recovery that re-attached; a failed call recovers only
        if no one has since its call started. ``_reclaim_from``: the sessions to reclaim while
        a recovery has not yet had its Reclaim answered (empty otherwise): the one of before
        the restart, and each session a cut Reclaim may have moved the sequences into.

    Invariants: every handle in ``_live`` is neither released nor lost and is keyed by its
    current id; at most one KeepAlive runs, and none after ``close()``.
    """

    def __init__(self, socket_path: str, layout: KVLayout, name: str, *, mapped: bool | None,
                 lease_renew: float | None, reconnect: bool, backoff: Backoff | None,
                 timeout_s: float | None, request_timeout_ms: float | None = None,
                 max_model_len: int | None = None) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a prefixd.client.KVLayout, got {type(layout).__name__}")
        self.socket_path = str(socket_path)
        self.layout = layout
        self.name = name
        self._lease_renew = lease_renew
        self._reconnect = reconnect
        # -- fail fast (breaker.py): request-path calls get ``request_timeout_ms``, Attach,
        # Reclaim and the bulk KV rpcs keep ``timeout_s``; None: no breaker, one deadline
        self._bulk_timeout = timeout_s
        if max_model_len is not None and (not isinstance(max_model_len, int) or not 0 < max_model_len < 2**32):
            raise InvalidArgument(f"max_model_len must be a positive int (or None), got {max_model_len!r}")
        self._breaker: Breaker | None = None
        if request_timeout_ms is not None:
            if not request_timeout_ms > 0:
                raise InvalidArgument(f"request_timeout_ms must be > 0 (or None), got {request_timeout_ms!r}")
            self._breaker = Breaker(self._probe_daemon, name=name)
        self._timeout = request_timeout_ms / 1000 if request_timeout_ms is not None else timeout_s
        # -- end fail fast
        self._lock = threading.RLock()
        self._live: dict[int, Sequence] = {}
        self._generation = 0
        self._last_reclaimed: list[Sequence] = []
        self._reclaim_from: list[int] = []
        self._closed = False
        self._detached = False
        self._keepalive: KeepAlive | None = None
        self.pool: MappedPool | None = None
        self.id = 0
        self.recoveries = 0
        self._conn = Connection(self.socket_path, layout, name, mapped=mapped, backoff=backoff or Backoff(),
                                bulk_timeout=timeout_s, max_model_len=max_model_len or 0,
                                stopped=lambda: self._closed)
        self._stub = self._conn.stub
        try:
            # A socket that is there but refuses is a daemon starting or recovering: wait for it.
            # No socket at all is no daemon: fail at once.
            self._adopt(self._conn.attach(retry=reconnect and os.path.exists(self.socket_path)))
        except BaseException:
            self._conn.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> int:
        """Detach: the daemon releases every sequence still held (uncommitted blocks freed).
        Returns the sequences it released (0 if the daemon was gone). Idempotent."""
        # Set before taking the lock: a recovery in flight (holding it) gives up at its next
        # wait, and the stream Detach ends must not start a new one.
        self._closed = True
        if self._breaker is not None:
            self._breaker.stop()
        with self._lock:
            if self._detached:
                return 0
            self._detached = True
            released = 0
            try:
                released = self._stub.Detach(pb.DetachRequest(session_id=self.id), timeout=5.0).released_sequences
            except grpc.RpcError as exc:
                log.info("detach failed (the session ends with its lease) session=%#x error=%s",
                         self.id, from_rpc_error(exc))
            # NOTE: the keep-alive stops after Detach, not before: the daemon ends a session
            # whose stream ends, and Detach would then answer NOT_FOUND without its count.
            self._stop_keepalive()
            for seq in self._live.values():
                seq.released = True
            self._live.clear()
            self.pool = None
            self._conn.close()
            return released

    detach = close

    @property
    def mapped(self) -> bool:
        """True when KV and attention go through the mapped pool."""
        return self.pool is not None

    @property
    def lease_held(self) -> bool:
        """True while the keep-alive stream is up, so slots handed out under ``epoch`` still
        are what they were: for a caller that copies into the mapped pool through slots it got
        from another session (the vLLM connector's worker side checks it around its copies)."""
        ka = self._keepalive
        return ka is not None and ka.lost is None

    def _adopt(self, reply: pb.AttachReply) -> None:
        """Make an Attach reply this attachment's session: map the pools, start the lease."""
        self.id = reply.session_id
        self.epoch = reply.epoch
        self.tenant = reply.tenant
        self.lease_s = reply.lease_s
        self.max_message_bytes = reply.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        self.pool = self._conn.map(reply.pools)
        self._keepalive = KeepAlive(self._stub, self.id, self.lease_s, self._on_lease_lost,
                                    renew_s=self._lease_renew).start()
        log.info("attached session=%#x epoch=%d tenant=%s mapped=%s", self.id, self.epoch, self.tenant,
                 self.pool is not None)

    def _stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop()
            self._keepalive = None

    # -- recovery ----------------------------------------------------------------------------

    def _on_lease_lost(self, error: PrefixdError) -> None:
        """KeepAlive thread: the stream broke. Recover now (reclaim has a grace period)."""
        if not self._reconnect or self._closed:
            return
        if self._breaker is not None:  # fail fast: its probe recovers once the daemon answers
            self._breaker.trip(error)
            return
        gen = self._generation
        threading.Thread(target=self._recover_quietly, args=(gen,), name="prefixd-reconnect", daemon=True).start()

    def _recover_quietly(self, gen: int) -> None:
        try:
            self._recover(gen)
        except PrefixdError as exc:
            log.warning("background reconnect failed (the next call tries again) error=%s", exc)

    def _recover(self, gen: int) -> list[Sequence] | None:
        """Re-attach and reclaim unless the old session is still alive or someone already did.

        Returns the live handles after a re-attach (updated in place), None if the session
        was alive. Raises Unavailable when the daemon did not come back in time.
        """
        with self._lock:
            if self._closed:
                raise NotFound("the session is closed; connect again")
            if self._generation != gen:
                return list(self._last_reclaimed)
            if self._conn.session_alive(self.id, self._timeout):
                if self._keepalive is None or not self._keepalive.alive():
                    self._stop_keepalive()
                    self._keepalive = KeepAlive(self._stub, self.id, self.lease_s, self._on_lease_lost,
                                                renew_s=self._lease_renew).start()
                return None
            self._stop_keepalive()
            # The sessions whose sequences to reclaim: the one before the restart, kept across
            # a recovery that re-attached but failed before its Reclaim answered.
            previous = self._reclaim_from or [self.id]
            self._reclaim_from = previous
            # NOTE: the new session is used (``self.id``, the pool, the lease) only once its
            # Reclaim is applied to the handles. Made visible at Attach, a call on another
            # thread opened a sequence in it during the Reclaim, which the recovery then marked
            # lost (or never reclaimed: the client waited on it), and a mapped store passed the
            # lease check with a handle still holding the old daemon's block table.
            attached = self._conn.attach(retry=True)
            try:
                reply = reclaim_sessions(self._stub, attached.session_id, previous, self._bulk_timeout)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if isinstance(err, Unavailable):  # down again: the next recovery reclaims, see
                    self._reclaim_from = previous + [attached.session_id]  # reclaim_sessions
                    raise err from None
                log.warning("reclaim refused, the session's sequences are lost previous=%s error=%s",
                            previous, err)
                reply = pb.ReclaimReply()
            self._reclaim_from = []
            handles = apply_reclaim(self._live, reply, self.layout.block_size)
            self._adopt(attached)
            for seq_id in unknown_reclaimed(self._live, reply):
                self._conn.release_quietly(self.id, seq_id, self._timeout)
            self._last_reclaimed = handles
            self._generation += 1
            self.recoveries += 1
            log.warning("reconnected session=%#x previous=%s reclaimed=%d lost=%d", self.id, previous,
                        sum(s.reclaimed for s in handles), sum(s.lost for s in handles))
            return handles

    def _check_lease(self, seqs) -> None:
        """Before a mapped store or load: the keep-alive stream must be up.

        NOTE: a mapped access never talks to the daemon, so it cannot see a restart. A daemon
        that restarted frees the slots of sequences it never saw committed and may hand them to
        another client; a store through the old block table would then land in that client's
        KV. The keep-alive stream breaks the moment the daemon dies, so a broken (or
        recovering) lease sends the access through recovery first, and a handle the recovery
        changed raises DaemonRestarted instead of being used.
        """
        ka = self._keepalive
        if ka is None or ka.lost is not None:
            gen = self._generation
            if self._breaker is not None and self._reconnect:  # fail fast: the probe recovers
                self._breaker.trip((ka.lost if ka is not None else None) or Unavailable("no keep-alive stream"))
                raise self._breaker.error("a mapped access")
            if not self._reconnect:
                raise NotFound(f"session {self.id:#x} lost its keep-alive stream (daemon restarted or lease "
                               f"lapsed): connect again")
            self._recover(gen)
        # a recovery (this one, or one that ended on another thread since the caller checked
        # the handles) may have cut them: the store must not go through the new block tables
        for seq in seqs:
            seq.check_live()

    def _call(self, fn, *, retry_safe: bool, what: str):
        """Run ``fn()`` (which reads ``self._stub``/``self.id`` and the handles' ids when called);
        on a lost session recover, then retry (``retry_safe``) or raise DaemonRestarted."""
        if self._closed:
            raise NotFound("the session is closed; connect again")
        breaker = self._breaker
        if breaker is not None and not breaker.allow():
            raise breaker.error(what)
        gen = self._generation
        try:
            return fn()
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
        if breaker is not None and self._breaker_trips_on(err):
            breaker.trip(err)  # the probe (on its own thread) recovers the session if it must
            raise err
        if not self._reconnect or not isinstance(err, (Unavailable, NotFound)):
            raise err
        handles = self._recover(gen)
        if handles is None:  # the session was alive: the error was the call's own
            raise err
        if retry_safe:
            try:
                return fn()
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
        for seq in handles:  # told now: the next call naming them proceeds
            seq.restarted = False
        raise DaemonRestarted(f"the daemon restarted during {what}; the session re-attached and reclaimed "
                              f"its sequences (see each one's num_tokens / lost): redo the {what}", handles)

    # -- fail fast ---------------------------------------------------------------------------

    def _breaker_trips_on(self, err: PrefixdError) -> bool:
        """A missed deadline or an unreachable daemon; with reconnect, a lost session too (the
        probe re-attaches off the caller's thread)."""
        return isinstance(err, (Unavailable, DeadlineExceeded)) or (self._reconnect and isinstance(err, NotFound))

    def _probe_daemon(self) -> bool:
        """The breaker's probe (its own thread): a Stats of this session under the request
        deadline. True once the daemon answered and the session is usable again: with
        reconnect, a session the daemon no longer knows (restart, lapsed lease) is re-attached
        and reclaimed here first, so that no caller pays the Attach."""
        gen = self._generation
        try:
            self._stub.Stats(pb.StatsRequest(session_id=self.id), timeout=self._timeout)
            alive = True
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if isinstance(err, (Unavailable, DeadlineExceeded)):
                return False
            alive = not isinstance(err, NotFound)
        ka = self._keepalive
        if self._reconnect and not self._closed and (not alive or ka is None or ka.lost is not None):
            try:
                self._recover(gen)
            except Unavailable:
                return False
        return True

    @property
    def breaker(self) -> Breaker | None:
        """The session's circuit breaker (None without ``request_timeout_ms``)."""
        return self._breaker

    def check_invariants(self) -> None:
        if self._breaker is not None:
            self._breaker.check_invariants()
        for seq_id, seq in self._live.items():
            assert seq.id == seq_id and not seq.released and not seq.lost, seq
            seq.check_invariants()
        if self._detached:
            assert self._closed and self._keepalive is None and not self._live
        if self._keepalive is not None:
            self._keepalive.check_invariants()

