"""The ``PrefixCache`` servicer of one tenant's socket: the control rpcs.

Each handler runs on the event loop that owns the engine and calls the engine directly (its
calls take microseconds and never wait for an fsync). A commit's acknowledgment waits for its
ticket with ``ack_wait.durable``: the loop serves other calls meanwhile, so commits of many
clients share WAL groups. The KV data path (WriteKV, ReadKV, Attend) is ``kv_rpc``; the daemon's
own rpcs (Stats, SubscribeEvents, Status, Checkpoint) are ``admin_rpc.AdminRpcs``, a part the
servicer holds and delegates to; the call wrapper ``rpc`` is ``rpc_call``.

Every failure is answered with a status (``status.status_of``): no request, however malformed,
raises out of a handler, and a refused call changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from prefixd.api.layout import KVLayout, as_token_bytes
from prefixd.daemon import admission
from prefixd.daemon.ack_wait import durable
from prefixd.daemon.admin_rpc import AdminRpcs
from prefixd.daemon import kv_rpc
from prefixd.daemon.core import DaemonCore
from prefixd.daemon.pool_descriptors import pool_descriptors
from prefixd.daemon.rpc_call import rpc
from prefixd.daemon.sessions import Session
from prefixd.daemon.status import RpcFailure, exhausted, invalid, status_of, unavailable
from prefixd.storage.errors import StorageError

log = logging.getLogger(__name__)

ATTACH_REPLY_S = 0.25  # an Attach waiting for a new pool answers this long before its deadline


def tokens_of(raw: bytes) -> bytes:
    """Packed int32 token ids from a request field (checked)."""
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise invalid(f"tokens must be packed little-endian int32 bytes (a multiple of 4), "
                      f"got {len(raw)} bytes")
    if not raw:
        raise invalid("tokens are empty: send at least one token id")
    return as_token_bytes(raw)


def table_bytes(table) -> bytes:
    """A block table as packed little-endian int32 (``struct``: half numpy's time for the
    ~136 entries of a 2k-token reply, with no array made on the way)."""
    return struct.pack(f"<{len(table)}i", *table)


def seq_reply(seq) -> pb.SequenceReply:
    return pb.SequenceReply(seq_id=seq.id, num_tokens=seq.num_tokens,
                            cached_tokens=seq.cached_tokens,
                            block_table=table_bytes(seq.block_table), num_indexed=seq.num_indexed)


def layout_of(msg: pb.KVLayout) -> KVLayout:
    try:
        return KVLayout(msg.model_id, msg.num_layers, msg.num_kv_heads, msg.head_dim,
                        msg.dtype, msg.block_size)
    except ValueError as exc:
        raise invalid(f"bad KV layout: {exc}") from None


def attach_wait_s(remaining: float | None) -> float | None:
    """How long an Attach waits for its pool: until ``ATTACH_REPLY_S`` before the call's
    deadline (``remaining`` seconds away; None: no deadline, as long as it takes)."""
    if remaining is None:
        return None
    return max(remaining - max(ATTACH_REPLY_S, remaining / 10), 0.0)


async def _same_session(first, stream, session_id: int):
    """The chunks of one WriteKV stream, each checked to name the stream's session."""
    yield first
    async for chunk in stream:
        if chunk.session_id != session_id:
            raise invalid("every chunk of one WriteKV stream must name the same session")
        yield chunk


class PrefixCacheService(pb_grpc.PrefixCacheServicer):
    """The servicer of ``tenant``'s socket. Every session it makes is stamped with ``tenant``,
    and every call finds sessions of ``tenant`` only. The daemon's own rpcs are its ``admin``
    part's (``admin_rpc.AdminRpcs``)."""

    def __init__(self, core: DaemonCore, tenant: str) -> None:
        self.core = core
        self.tenant = tenant
        self.admin = AdminRpcs(core, tenant, self._session)

    # -- the daemon's own rpcs: the admin part's (each already wears ``rpc``) ----------------------

    async def Stats(self, request, context):
        return await self.admin.Stats(request, context)

    async def SubscribeEvents(self, request, context):
        async for event in self.admin.SubscribeEvents(request, context):
            yield event

    async def Status(self, request, context):
        return await self.admin.Status(request, context)

    async def Checkpoint(self, request, context):
        return await self.admin.Checkpoint(request, context)

    def _session(self, session_id: int) -> Session:
        session = self.core.sessions.get(session_id, self.tenant)
        self.core.sessions.ping(session)
        return session

    async def _pool(self, layout: KVLayout, wait_s: float | None):
        """The tenant's pool of ``layout``; a new one only within the tenant's pool limit and
        when its files' first extents fit the budgets (RESOURCE_EXHAUSTED otherwise: Attach
        checked them, ``TierStore`` charges them before it makes a file), made off the loop
        (``OffLoop.pool``), waited for at most ``wait_s`` (then UNAVAILABLE: it is still
        being made).

        NOTE: the engine writes a new pool's manifest before it makes the pool's files; a
        pool whose files then fail is removed (``OffLoop._make``), or every later start would
        fail opening it (a single Attach with a huge layout bricked the daemon's next start).
        """
        engine = self.core.engine
        offloop = self.core.offloop
        mine = [info.layout for info in engine.pools() if info.tenant == self.tenant]
        if layout in mine:
            return engine.pool(self.tenant, layout)
        closed = engine.closed_pools(self.tenant)  # on disk still: each counts, and reopens
        if not offloop.is_making(self.tenant, layout):  # else its checks passed when it began
            if layout not in closed:
                self.core.sessions.check_new_pool(
                    self.tenant, len(mine) + len(closed) + offloop.making(self.tenant))
            engine.make_room_for(self.tenant, layout)  # its first extents, from the coldest blocks
        try:
            pool = await offloop.pool(engine, self.tenant, layout, wait_s)
        except StorageError as exc:
            raise exhausted(f"cannot make a pool for layout {layout.model_id!r}: {exc}") from None
        if pool is None:
            raise unavailable(f"the pool for layout {layout.model_id!r} is being made (its files, "
                              f"the first time a layout attaches): Attach again in a moment")
        return pool

    # -- sessions ------------------------------------------------------------------------------

    @rpc
    async def Attach(self, request, context):
        layout = layout_of(request.layout)
        name = request.client_name[:128] or "unnamed"
        admission.check_attach(self.core.engine.budgets, self.tenant, layout,
                               request.max_model_len,
                               max_block_bytes=self.core.config.limits.max_block_bytes)
        # a new layout's pool is made off the loop; the Attach waits for it until just before
        # its deadline, then answers UNAVAILABLE (retry): never a deadline the client cannot
        # know, and the session is made only once the pool is (a caller gone meanwhile leaves
        # none behind)
        pool = await self._pool(layout, attach_wait_s(context.time_remaining()))
        remaining = context.time_remaining()
        if context.cancelled() or (remaining is not None and remaining <= 0):
            # a loop held past the call's deadline (a loaded host) woke up after the client
            # gave up: a session made now would have no one to hold it until its lease ends
            raise unavailable("the Attach's deadline passed while its pool was being made: "
                              "Attach again")
        session = self.core.sessions.attach(self.tenant, name, layout, pool)
        return pb.AttachReply(session_id=session.id, lease_s=self.core.config.lease_s,
                              pools=pool_descriptors(pool), tenant=self.tenant,
                              epoch=self.core.epoch,
                              max_message_bytes=self.core.config.max_message_bytes)

    async def KeepAlive(self, request_iterator, context):
        """Holds the session while the stream lasts; ends it when the stream ends (not at a
        daemon shutdown: its sequences stay in the log for a Reclaim after the restart)."""
        core = self.core
        core.calls["KeepAlive"] += 1
        session = None
        task = asyncio.current_task()
        core.keepalive_tasks.add(task)
        try:
            async for ping in request_iterator:
                if session is None:
                    core.check_serving()
                    session = self._session(ping.session_id)
                    session.keepalive_streams += 1
                elif ping.session_id != session.id:
                    raise invalid("one KeepAlive stream holds one session: open another stream")
                elif session.ended:
                    raise RpcFailure(grpc.StatusCode.NOT_FOUND,
                                     f"session {session.id:#x} ended (lease expired or detached): "
                                     f"Attach again")
                core.sessions.ping(session)
                yield pb.KeepAliveReply(lease_s=core.config.lease_s)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            core.errors["KeepAlive"] += 1
            code, message = status_of(exc)
            await context.abort(code, message)
        finally:
            core.keepalive_tasks.discard(task)
            if session is not None:
                session.keepalive_streams -= 1
                if not session.keepalive_streams and not session.ended and core.state != "stopping":
                    core.sessions.end(session, "keepalive stream ended")

    @rpc
    async def Detach(self, request, context):
        session = self._session(request.session_id)
        return pb.DetachReply(released_sequences=self.core.sessions.end(session, "detached"))

    @rpc
    async def Reclaim(self, request, context):
        session = self._session(request.session_id)
        if not request.previous_session_id:
            raise invalid("previous_session_id is 0: send the session id of before the restart")
        if request.previous_session_id == session.id:
            raise invalid("previous_session_id is this session: send the one of before the restart")
        reply = pb.ReclaimReply()
        for item in session.pool.reclaim(request.previous_session_id, session.id):
            out = reply.sequences.add(previous_seq_id=item.old_id, num_tokens=item.num_tokens)
            if item.seq is not None:
                seq = item.seq
                session.track(seq.id, len(seq.block_table))
                out.seq_id = seq.id
                out.block_table = table_bytes(seq.block_table)
                out.tokens = bytes(seq.tokens)
        # NOTE: answered once the reopen's records (the sequences now in this session) are
        # durable: from the reply on the client reclaims from this session only, and a kill
        # before those records were written brought the sequences back under the old one,
        # which it no longer asks for (tests/crash/test_reclaim_durable.py).
        await durable(session.pool.flush())
        return reply

    # -- sequences -----------------------------------------------------------------------------

    @rpc
    async def Lookup(self, request, context):
        session = self._session(request.session_id)
        r = session.pool.lookup(tokens_of(request.tokens))
        return pb.LookupReply(cached_tokens=r.cached_tokens, device_tokens=r.device_tokens,
                              host_tokens=r.host_tokens, disk_tokens=r.disk_tokens,
                              unverified_tokens=r.unverified_tokens)

    @rpc
    async def Open(self, request, context):
        session = self._session(request.session_id)
        tokens = tokens_of(request.tokens)
        bs = session.layout.block_size
        self.core.sessions.check_room(session, 1, -(-(len(tokens) >> 2) // bs))
        seq = session.pool.open(tokens, session_id=session.id)
        session.track(seq.id, len(seq.block_table))
        return pb.OpenReply(sequence=seq_reply(seq))

    @rpc
    async def Extend(self, request, context):
        session = self._session(request.session_id)
        session.owns(request.seq_id)
        if len(request.tokens) % 4:
            raise invalid(f"tokens must be packed int32 bytes, got {len(request.tokens)} bytes")
        pool = session.pool
        seq = pool.sequence(request.seq_id)
        bs = session.layout.block_size
        grow = -(-(seq.num_tokens + len(request.tokens) // 4) // bs) - len(seq.block_table)
        self.core.sessions.check_room(session, 0, max(grow, 0) + 1)
        if request.tokens:
            pool.extend(request.seq_id, as_token_bytes(request.tokens))
        session.track(seq.id, len(seq.block_table))
        return pb.ExtendReply(sequence=seq_reply(seq))

    @rpc
    async def Commit(self, request, context):
        session = self._session(request.session_id)
        session.owns(request.seq_id)
        ticket = session.pool.commit(request.seq_id, request.durability or "crash")
        seq = session.pool.sequence(request.seq_id)
        reply = pb.CommitReply(sequence=seq_reply(seq))  # the table as of the commit
        reply.indexed_blocks = await durable(ticket) or 0
        return reply

    @rpc
    async def Fork(self, request, context):
        session = self._session(request.session_id)
        session.owns(request.seq_id)
        n = request.num_children
        if not 1 <= n <= 1024:
            raise invalid(f"num_children must be 1..1024, got {n}")
        parent = session.pool.sequence(request.seq_id)
        self.core.sessions.check_room(session, n, n * len(parent.block_table))
        children = session.pool.fork(request.seq_id, n)
        session.track(parent.id, len(parent.block_table))
        for child in children:
            session.track(child.id, len(child.block_table))
        return pb.ForkReply(children=[seq_reply(c) for c in children])

    @rpc
    async def Release(self, request, context):
        session = self._session(request.session_id)
        session.owns(request.seq_id)
        durability = request.durability or "crash"
        ticket = session.pool.release(request.seq_id, commit=request.commit, durability=durability)
        session.untrack(request.seq_id)
        await durable(ticket)
        return pb.ReleaseReply()

    # -- KV data path (kv_rpc) -----------------------------------------------------------------

    async def WriteKV(self, request_iterator, context):
        core = self.core
        core.calls["WriteKV"] += 1
        try:
            core.check_serving()
            stream = request_iterator.__aiter__()
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                raise invalid("WriteKV got no chunk: send at least one") from None
            session = self._session(first.session_id)
            return await kv_rpc.write_kv(session, _same_session(first, stream, session.id),
                                        core.config.max_message_bytes)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            core.errors["WriteKV"] += 1
            await context.abort(*status_of(exc))

    async def ReadKV(self, request, context):
        core = self.core
        core.calls["ReadKV"] += 1
        try:
            core.check_serving()
            session = self._session(request.session_id)
            for reply in kv_rpc.read_kv(session, request, core.config.max_message_bytes):
                yield reply
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            core.errors["ReadKV"] += 1
            await context.abort(*status_of(exc))

    @rpc
    async def Attend(self, request, context):
        """Checks and the new K/V on the loop; the kernel and the reply's encoding on the
        compute threads, so other clients' calls go on meanwhile (a CPU pool's decode step of
        16 x 2k tokens is 7-12 ms of kernel here), the batch split over them
        (``attend_job``'s NOTE)."""
        session = self._session(request.session_id)
        job = kv_rpc.prepare_attend(session, request, self.core.config.max_message_bytes)
        loop, compute = asyncio.get_running_loop(), self.core.compute
        parts = job.parts(self.core.compute_threads)
        if len(parts) == 1:
            return await loop.run_in_executor(compute, job)
        outputs = await asyncio.gather(*(loop.run_in_executor(compute, job.run, a, b)
                                         for a, b in parts))
        return await loop.run_in_executor(compute, job.reply, outputs)
