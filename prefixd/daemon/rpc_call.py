"""One rpc call's wrapper (``rpc``): counted, timed, checked that the daemon serves, and any
failure answered as a status (``status.status_of``) instead of raised out of the handler.

Every unary handler of ``PrefixCacheService`` (``prefixd.daemon.service``, ``admin_rpc``) wears
it; the streaming ones (KeepAlive, WriteKV, ReadKV) do the same by hand around their streams.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from time import perf_counter

import grpc

from prefixd.daemon.status import status_of

log = logging.getLogger(__name__)

_ALWAYS = {"Status"}  # answered in every state (the others need the daemon serving)


def rpc(fn):
    """Count and time the call, check the daemon serves (unless ``always``), answer failures
    as statuses."""
    name = fn.__name__

    @functools.wraps(fn)
    async def handler(self, request, context):
        core = self.core
        core.calls[name] += 1
        core.in_flight += 1
        core.open_calls += 1
        context.add_done_callback(core.call_closed)  # once the status went out (a stop waits)
        t0 = perf_counter()
        status = "CANCELLED"
        counted = False
        try:
            if name not in _ALWAYS:
                core.check_serving()
            reply = await fn(self, request, context)
            status = "OK"
            return reply
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            core.errors[name] += 1
            code, message = status_of(exc)
            log.debug("call refused method=%s code=%s message=%s", name, code.name, message)
            # NOTE: counted before the status goes out: the client may act on it (a scrape)
            # before this coroutine resumes after ``abort``.
            core.in_flight -= 1
            core.rpc_times.observe(name, code.name, perf_counter() - t0)
            counted = True
            await context.abort(code, message)
        finally:
            if not counted:
                core.in_flight -= 1
                core.rpc_times.observe(name, status, perf_counter() - t0)

    return handler
