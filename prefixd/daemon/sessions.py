"""Sessions: which client holds which sequences, for how long (DESIGN.md "The API").

A session is made by ``Attach`` on one tenant's socket, for one KV layout, and holds the
sequences it opened, forked or reclaimed. It ends on ``Detach``, when its ``KeepAlive`` stream
ends, or when its lease runs out (no ping for ``lease_s``); ending releases every sequence it
still holds (uncommitted blocks are freed, committed ones stay cached), so a client that dies
leaks nothing.

Everything here runs on the daemon's event-loop thread, like the engine calls it makes.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from prefixd.api.layout import KVLayout
from prefixd.cache.errors import UnknownSequence
from prefixd.config.daemon_settings import Limits
from prefixd.daemon.status import exhausted, not_found

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    """One attached client.

    Invariants: every id in ``blocks`` is a live sequence of ``pool`` opened for this session,
    and ``blocks[seq]`` is the length of its block table as of the last call that changed it;
    ``held`` is the sum of ``blocks``.
    """

    id: int
    tenant: str
    name: str
    layout: KVLayout
    pool: object  # the tenant's DurableCache for ``layout``
    attached_at: float
    last_ping: float  # on the table's ``LeaseClock``
    blocks: dict[int, int] = field(default_factory=dict)
    held: int = 0
    keepalive_streams: int = 0
    ended: bool = False

    def owns(self, seq_id: int) -> None:
        """Raises NOT_FOUND unless ``seq_id`` is one of this session's live sequences."""
        if seq_id not in self.blocks:
            raise not_found(f"sequence {seq_id} is not open in session {self.id:#x}: open it "
                            f"(again), or Reclaim it after a daemon restart")

    def track(self, seq_id: int, num_blocks: int) -> None:
        """Record (or update) a sequence's block-table length."""
        self.held += num_blocks - self.blocks.get(seq_id, 0)
        self.blocks[seq_id] = num_blocks

    def untrack(self, seq_id: int) -> None:
        self.held -= self.blocks.pop(seq_id, 0)


class LeaseClock:
    """Seconds the daemon's loop ran, advanced by its tick (``advance``), by at most
    ``max_step_s`` a turn.

    A tick that comes later than ``max_step_s`` after the one before means the loop did not
    run meanwhile (the process was stopped, or something held the loop): that gap counts as
    ``max_step_s``. So ``now()`` moves only while the daemon could read its clients' pings,
    and a lease counted on it expires only when the daemon, running, heard nothing for the
    lease. Pings read after a stall but before the tick that notices it are stamped with the
    clock as it stood, which the stall's credit leaves within ``max_step_s`` of right.

    NOTE: a clock of ticks, not ``time.monotonic()`` less the stalls found afterwards: the
    latter stamps a ping read before the tick notices the stall with the stall's length ahead
    of the clock, and gives that session a lease as long as the stall extra.

    Invariants: ``now()`` never decreases; one ``advance`` adds at most ``max_step_s``.
    """

    def __init__(self, max_step_s: float, clock=time.monotonic) -> None:
        if not max_step_s > 0:
            raise ValueError(f"max_step_s must be > 0, got {max_step_s!r}")
        self.max_step_s = float(max_step_s)
        self._clock = clock
        self._last = clock()
        self._now = 0.0
        self.stalled_s = 0.0  # wall time the clock did not count (stalls)

    def now(self) -> float:
        return self._now

    def advance(self) -> float:
        """One tick: count the time since the last one, at most ``max_step_s``; returns the
        seconds not counted (0 unless the loop stalled)."""
        wall = self._clock()
        gap, self._last = wall - self._last, wall
        step = min(max(gap, 0.0), self.max_step_s)
        self._now += step
        self.stalled_s += gap - step
        return gap - step


# How far one tick may move the lease clock: the tick runs every 0.1 s; a gap past this is a
# stall (the loop did not run), not time in which pings could be read.
MAX_LEASE_STEP_S = 0.25


class SessionTable:
    """Every live session, by id; per-tenant totals for the limits.

    Invariants: ``_tenant_seqs[t]`` / ``_tenant_blocks[t]`` are the sums over tenant ``t``'s
    live sessions of ``len(blocks)`` / ``held``; no ended session is in ``_sessions``.
    """

    def __init__(self, lease_s: float, limits: Limits | None = None,
                 clock: LeaseClock | None = None) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = float(lease_s)
        self.clock = clock or LeaseClock(MAX_LEASE_STEP_S)
        self.limits = limits or Limits()
        self._sessions: dict[int, Session] = {}
        # called with each ended session once its sequences are released (the daemon notes
        # its pool for closing if it is now unused: ``DaemonCore.close_empty_pools``)
        self.on_end = None
        self.ended_total = 0
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def attach(self, tenant: str, name: str, layout: KVLayout, pool) -> Session:
        """A new session with a fresh random id (never 0, never one in use)."""
        while True:
            sid = secrets.randbits(63)
            if sid and sid not in self._sessions:
                break
        session = Session(sid, tenant, name, layout, pool, time.monotonic(), self.clock.now())
        self._sessions[sid] = session
        log.info("session attached session=%#x tenant=%s client=%s model=%s", sid, tenant,
                 name, layout.model_id)
        return session

    def get(self, session_id: int, tenant: str) -> Session:
        """The live session ``session_id`` of ``tenant``.

        Raises NOT_FOUND for an unknown, ended, or another tenant's session (the same answer,
        so one tenant cannot probe another's ids).
        """
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise not_found(f"no session {session_id:#x} on this socket (ended, expired, or the "
                            f"daemon restarted): Attach again, then Reclaim the old id")
        return session

    def ping(self, session: Session) -> None:
        session.last_ping = self.clock.now()

    def check_room(self, session: Session, new_seqs: int, new_blocks: int) -> None:
        """Raises RESOURCE_EXHAUSTED if ``session`` may not take that many more."""
        lim = self.limits
        if len(session.blocks) + new_seqs > lim.sequences_per_session:
            raise exhausted(f"session holds {len(session.blocks)} sequences, the limit is "
                            f"{lim.sequences_per_session}: release some first")
        if session.held + new_blocks > lim.blocks_per_session:
            raise exhausted(f"session holds {session.held} blocks and asks {new_blocks} more, "
                            f"the limit is {lim.blocks_per_session}: release some first")
        seqs = blocks = 0
        for s in self._sessions.values():
            if s.tenant == session.tenant:
                seqs += len(s.blocks)
                blocks += s.held
        if seqs + new_seqs > lim.sequences_per_tenant:
            raise exhausted(f"tenant {session.tenant!r} holds {seqs} sequences, the limit is "
                            f"{lim.sequences_per_tenant}")
        if blocks + new_blocks > lim.blocks_per_tenant:
            raise exhausted(f"tenant {session.tenant!r} holds {blocks} blocks, the limit is "
                            f"{lim.blocks_per_tenant}")

    def check_new_pool(self, tenant: str, num_pools: int) -> None:
        """Raises RESOURCE_EXHAUSTED if ``tenant``, holding ``num_pools``, may not get another."""
        if num_pools >= self.limits.pools_per_tenant:
            raise exhausted(f"tenant {tenant!r} has {num_pools} pools (one per KV layout), the "
                            f"limit is {self.limits.pools_per_tenant}: attach with the layout of "
                            f"an existing pool, or ask the operator to raise "
                            f"[daemon.limits] pools_per_tenant")

    def end(self, session: Session, reason: str) -> int:
        """End ``session``: release (without commit) every sequence it holds. Returns how many.

        A release that fails is logged and the rest still released; the session is gone either
        way. Idempotent.
        """
        if session.ended:
            return 0
        session.ended = True
        self._sessions.pop(session.id, None)
        self.ended_total += 1
        released = 0
        for seq_id in list(session.blocks):
            try:
                session.pool.release(seq_id)
                released += 1
            except UnknownSequence:
                pass
            except Exception as exc:  # noqa: BLE001 - the others must still be released
                log.error("release at session end failed session=%#x seq=%d error=%r",
                          session.id, seq_id, exc)
            session.untrack(seq_id)
        log.info("session ended session=%#x tenant=%s client=%s reason=%s released=%d",
                 session.id, session.tenant, session.name, reason, released)
        if self.on_end is not None:
            self.on_end(session)
        return released

    def tick(self) -> int:
        """The lease sweep, once per loop tick: advance the lease clock (a stall counts as one
        step), then end every session whose lease ran out on it; returns how many ended."""
        stalled = self.clock.advance()
        if stalled > self.lease_s / 4 and self._sessions:
            log.warning("loop stalled; leases not charged for it stalled_s=%.3f sessions=%d",
                        stalled, len(self._sessions))
        return self.expire()

    def expire(self, now: float | None = None) -> int:
        """End every session whose lease ran out on the lease clock (``now``: a reading of
        it); returns how many."""
        now = self.clock.now() if now is None else now
        stale = [s for s in self._sessions.values() if now - s.last_ping > self.lease_s]
        for session in stale:
            self.end(session, "lease expired")
        self.expired_total += len(stale)
        return len(stale)

    def end_all(self, reason: str) -> None:
        for session in list(self._sessions.values()):
            self.end(session, reason)

    def check_invariants(self) -> None:
        for sid, s in self._sessions.items():
            assert s.id == sid and not s.ended
            assert s.held == sum(s.blocks.values()), (s.held, s.blocks)
            live = {seq.id for seq in s.pool.cache.sequences()}
            assert set(s.blocks) <= live, set(s.blocks) - live
