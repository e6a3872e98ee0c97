"""sd_notify without libsystemd: one datagram of ``KEY=value`` lines on ``$NOTIFY_SOCKET``.

The protocol (sd_notify(3)): systemd passes a ``AF_UNIX`` datagram socket's path in
``NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace: a NUL byte replaces it) and,
with ``WatchdogSec=``, the watchdog period in ``WATCHDOG_USEC`` (for the process whose pid is
``WATCHDOG_PID``, when set). The daemon sends ``STATUS=...`` (free text ``systemctl status``
shows), ``READY=1``, ``RELOADING=1`` (with ``MONOTONIC_USEC=``), ``STOPPING=1`` and
``WATCHDOG=1``. Outside systemd (no ``NOTIFY_SOCKET``) every send is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages to ``NOTIFY_SOCKET`` (taken from ``env`` once, at construction).

    Invariants: ``enabled`` iff a socket address was given; a failed send is logged once per
    kind of error and never raised (a lost notification must not stop the daemon; systemd
    acts on the missing READY or WATCHDOG itself).

    NOTE: the variables are removed from ``os.environ`` when ``unset_env`` is true (as
    ``sd_notify(unset_environment=1)``), so a child process (a Triton compiler, a tool) cannot
    send messages in the daemon's name; ``NotifyAccess=main`` in the unit says the same.
    """

    def __init__(self, env=None, *, unset_env: bool = False) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if raw.startswith("@"):
            self.address = b"\0" + raw[1:].encode()
        elif raw.startswith("/"):
            self.address = raw
        elif raw:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor @abstract: not notifying", raw)
        self.watchdog_usec = _watchdog_usec(env)
        if unset_env:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        self._sock: socket.socket | None = None
        self._errors: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send ``lines`` (``"READY=1"``, ``"STATUS=..."``) as one datagram; returns whether it
        went out. Newlines inside a line are replaced: each line is one assignment."""
        if self.address is None:
            return False
        data = "\n".join(line.replace("\n", " ") for line in lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(data, self.address)
            return True
        except OSError as exc:
            kind = type(exc).__name__
            if kind not in self._errors:
                self._errors.add(kind)
                log.warning("sd_notify send failed socket=%r error=%r", self.address, exc)
            return False

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading the config")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_usec(env) -> int:
    """The watchdog period in microseconds, or 0 when off (or meant for another pid)."""
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return 0
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number: no watchdog pings", env.get("WATCHDOG_USEC"))
        return 0
    return max(usec, 0)
