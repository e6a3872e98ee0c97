"""Waiting on the loop for an engine ticket (a ``concurrent.futures.Future`` that the WAL
committer resolves), the step between "the fsync covering this commit is done" and the reply
that acknowledges it.

``durable(ticket)`` is awaited by the handlers that acknowledge a commit. It costs no thread
per waiter and as few loop turns as asyncio allows:

- a ticket already resolved (a release without commit, ``index`` durability, a commit whose
  records were already durable) is answered at once, without giving the loop a turn;
- otherwise the ticket's done-callback (on the committer thread) schedules one call on the
  loop (``call_soon_threadsafe``), which settles a loop future the handler awaits.

Invariants: the ticket is never cancelled or otherwise touched from here (only read once it is
done); a cancelled handler cancels only its own loop future, and the commit goes on; a loop
that closed before the ticket resolved makes the callback a no-op (the daemon is stopping and
nobody waits for that reply).

NOTE: not ``asyncio.wrap_future(ticket)``. ``wrap_future`` chains a cancellation back to the
ticket: a cancelled call would cancel the engine's ticket, and the committer's ``set_result``
then raises InvalidStateError. Wrapping it in ``asyncio.shield`` avoids that but takes three
loop turns after the wake-up (``_set_state``, the shield's inner callback, the task's wake-up)
where one settle and the task's wake-up suffice, and three even for a ticket already done.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Future


async def durable(ticket: Future):
    """The result of ``ticket`` (or its exception), awaited on the running loop."""
    if ticket.done():
        return ticket.result()
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    ticket.add_done_callback(functools.partial(_wake, loop, waiter))
    return await waiter


def _wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future, ticket: Future) -> None:
    """The ticket's done-callback, on the thread that resolved it: settle ``waiter`` on its
    loop."""
    try:
        loop.call_soon_threadsafe(_settle, waiter, ticket)
    except RuntimeError:  # the loop is closed: the daemon stopped, nobody awaits this reply
        pass


def _settle(waiter: asyncio.Future, ticket: Future) -> None:
    """On the loop: hand the ticket's outcome to ``waiter`` unless its handler was cancelled."""
    if waiter.done():  # cancelled with its handler (the client went away): the commit goes on
        return
    if ticket.cancelled():
        waiter.cancel()
        return
    exc = ticket.exception()
    if exc is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(ticket.result())
