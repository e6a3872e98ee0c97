"""``daemon.ack_wait.durable``: an engine ticket awaited on the loop (no daemon process)."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future

import pytest

from prefixd.daemon.ack_wait import durable


def _resolve_later(ticket: Future, *, value=None, error: BaseException | None = None) -> threading.Thread:
    """Resolve ``ticket`` on another thread, as the WAL committer does."""

    def run() -> None:
        if error is not None:
            ticket.set_exception(error)
        else:
            ticket.set_result(value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_done_ticket_is_answered_without_a_loop_turn():
    """A release without commit (or ``index`` durability) hands the handler a ticket that is
    already done; it went through ``shield(wrap_future(...))``, three loop turns before the
    reply, like a ticket the committer still had to resolve."""

    async def main():
        turns = []
        asyncio.get_running_loop().call_soon(turns.append, "turn")
        value = await durable(_done(7))
        return value, list(turns)  # a copy: asyncio.run turns the loop again on its way out

    assert asyncio.run(main()) == (7, [])


def test_a_done_failed_ticket_raises_at_once():
    async def main():
        with pytest.raises(OSError, match="disk gone"):
            await durable(_failed(OSError("disk gone")))

    asyncio.run(main())


def test_a_ticket_resolved_on_another_thread_wakes_the_handler():
    async def main():
        ok, bad = Future(), Future()
        threads = [_resolve_later(ok, value=42), _resolve_later(bad, error=RuntimeError("log failed"))]
        assert await durable(ok) == 42
        with pytest.raises(RuntimeError, match="log failed"):
            await durable(bad)
        for thread in threads:
            thread.join()

    asyncio.run(main())


def test_a_cancelled_call_leaves_the_ticket_alone(caplog):
    """A client that died mid-commit cancelled its handler; ``wrap_future`` alone chained that
    to the engine's ticket, and the committer's ``set_result`` raised InvalidStateError."""

    async def main():
        ticket: Future = Future()
        task = asyncio.ensure_future(durable(ticket))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not ticket.cancelled()
        _resolve_later(ticket, value=1).join()  # would raise InvalidStateError on a cancelled ticket
        await asyncio.sleep(0.01)  # the settle call runs and finds the waiter cancelled
        return ticket

    with caplog.at_level(logging.ERROR):
        ticket = asyncio.run(main())
    assert ticket.result() == 1
    assert not caplog.records


def test_a_ticket_resolved_after_the_loop_closed_is_ignored(caplog):
    """The daemon stopped while a commit was in flight: resolving its ticket must not raise
    on the committer thread ("exception calling callback" in the log)."""
    ticket: Future = Future()

    async def main():
        task = asyncio.ensure_future(durable(ticket))
        await asyncio.sleep(0)
        task.cancel()

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
        _resolve_later(ticket, value=3).join()
    assert ticket.result() == 3
    assert not caplog.records


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut
