"""The daemon's event loop: uvloop's when it is installed, else asyncio's own.

``run(main)`` is how ``prefixd serve`` runs the daemon. The loop owns the engine and every
gRPC call (``server.py``), so its own cost per callback is paid by every request: uvloop's
loop (libuv, in C) runs the same ``grpc.aio`` server with fewer Python steps per wake-up,
ready-callback and timer than the stdlib's selector loop. ``PREFIXD_EVENT_LOOP=asyncio`` in
the environment keeps the stdlib loop (to rule the loop out when something misbehaves);
``uvloop`` requires uvloop.

NOTE: uvloop cuts the daemon's CPU per request (docs/design.md, "Daemon"). Nothing in
the daemon depends on the loop's kind: it uses only the asyncio API (signal handlers,
``call_soon_threadsafe``, ``run_in_executor``), which uvloop implements; ``grpc.aio`` runs on
any asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable

from prefixd.config.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "PREFIXD_EVENT_LOOP"
KINDS = ("auto", "uvloop", "asyncio")


def loop_factory(kind: str | None = None) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop to run the daemon on: ``(name, factory)``.

    Args:
        kind: ``"auto"`` (uvloop if installed), ``"uvloop"`` or ``"asyncio"``; None reads
            ``$PREFIXD_EVENT_LOOP`` (unset or empty: ``"auto"``).
    Raises:
        ConfigError: an unknown kind, or ``"uvloop"`` without uvloop installed.
    """
    if kind is None:
        kind = os.environ.get(ENV, "") or "auto"
    if kind not in KINDS:
        raise ConfigError(f"{ENV} must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ConfigError(f"{ENV}=uvloop but uvloop is not installed: "
                                  f"pip install uvloop, or unset {ENV}") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Callable[[], Awaitable], kind: str | None = None):
    """Run ``main()`` to completion on a new loop of ``loop_factory(kind)``; returns its result.

    Raises ConfigError (``loop_factory``) before ``main`` is called."""
    name, factory = loop_factory(kind)
    log.info("event loop %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())
