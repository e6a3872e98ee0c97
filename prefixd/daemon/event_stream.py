"""The ``SubscribeEvents`` rpc: a tenant's KV events, replayed from the ring, then live.

One handler per stream, on the loop: it sends the entries of its ``Subscriber`` (a cursor
into the tenant's ``EventJournal``) as ``prefixd.v1.KVEvent`` messages and sleeps on the
subscriber's ``wake`` when it has caught up. Each ``yield`` waits for gRPC to take the
message (HTTP/2 flow control), so a slow router holds only its own handler: the journal keeps
appending without waiting, and cuts the subscriber off once it lags ``subscriber_queue``
entries. The stream ends with a status:

- RESOURCE_EXHAUSTED: the subscriber fell too far behind (or the ring dropped what it was
  replaying): subscribe again from the last number received; it resumes from the ring;
- UNAVAILABLE: the daemon is stopping (``EventJournals.close`` at SIGTERM, before the drain);
- NOT_FOUND: the session the request named ended (or is not one of this socket's tenant).

NOTE: the stream is not counted ``in_flight`` (the drain at a stop waits for calls that
finish by themselves, and a subscription only ends when told to) but is one of
``open_calls``: the stop ends it, then waits (within the grace) until its UNAVAILABLE went out.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon.event_journal import JournalEntry
from prefixd.daemon.status import RpcFailure, status_of

log = logging.getLogger(__name__)

SESSION_CHECK_S = 1.0  # how often an idle stream looks whether its session ended


def encode(entry: JournalEntry, epoch: int) -> pb.KVEvent:
    return pb.KVEvent(sequence_number=entry.sequence_number, kind=entry.kind, tier=entry.tier,
                      block_hashes=entry.block_hashes, epoch=epoch, model_id=entry.model_id,
                      block_size=entry.block_size, parent_block_hash=entry.parent_block_hash,
                      tokens=entry.tokens)


async def subscribe_events(core, tenant: str, request, context):
    """The rpc's body (an async generator of ``KVEvent``); see the module docstring."""
    core.calls["SubscribeEvents"] += 1
    core.open_calls += 1
    context.add_done_callback(core.call_closed)
    journal = sub = None
    try:
        core.check_serving()
        session = None
        if request.session_id:
            session = core.sessions.get(request.session_id, tenant)
            core.sessions.ping(session)
        journal = core.events.journal(tenant)
        sub = journal.subscribe(request.from_sequence_number, request.epoch)
        epoch = journal.epoch
        while True:
            entry = journal.next_entry(sub)
            if entry is not None:
                yield encode(entry, epoch)
                continue
            _check_open(sub, session, journal)
            sub.wake.clear()
            if journal.next_sequence_number > sub.cursor or sub.overflowed or sub.closed:
                continue  # something changed between next_entry and clear
            try:
                await asyncio.wait_for(sub.wake.wait(), SESSION_CHECK_S)
            except asyncio.TimeoutError:
                pass
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
        core.errors["SubscribeEvents"] += 1
        code, message = status_of(exc)
        await context.abort(code, message)
    finally:
        if sub is not None:
            journal.unsubscribe(sub)


def _check_open(sub, session, journal) -> None:
    """Raises the status that ends the stream, if it must end."""
    last = sub.cursor - 1
    resume = f"subscribe again with from_sequence_number={last} epoch={journal.epoch}"
    if sub.overflowed:
        raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"this subscriber fell too far behind (more than {journal.queue_limit} "
                         f"events, [daemon.events] subscriber_queue, live or while replaying from "
                         f"the ring of {journal.ring_size}) and was cut off after event "
                         f"{last}: read faster, then {resume}")
    if sub.closed:
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE,
                         f"the daemon is shutting down after event {last}: once it is back, "
                         f"{resume} (the stream then begins with a cleared event: numbers "
                         f"restart with the daemon)")
    if session is not None and session.ended:
        raise RpcFailure(grpc.StatusCode.NOT_FOUND,
                         f"session {session.id:#x} ended (lease expired or detached) after event "
                         f"{last}: Attach again, then {resume}")
