"""A fake ``NOTIFY_SOCKET`` for tests: a datagram socket the test binds, as systemd would,
collecting every message a daemon sends (one datagram = one message of ``KEY=value`` lines)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time


class NotifyListener:
    """Binds ``address`` (a path, or ``@name`` for the abstract namespace) and records the
    messages in arrival order on a thread. ``env()`` is what a daemon started under it gets."""

    def __init__(self, *, abstract: bool = False) -> None:
        self._dir = tempfile.mkdtemp(prefix="pdn-", dir="/tmp")
        if abstract:
            self.address = f"@prefixd-test-{os.getpid()}-{id(self):x}"
            bind_to = b"\0" + self.address[1:].encode()
        else:
            self.address = bind_to = os.path.join(self._dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def env(self, watchdog_usec: int = 0) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self._lock:
                self.messages.append(fields)

    def snapshot(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self.messages)

    def count(self, key: str) -> int:
        return sum(key in m for m in self.snapshot())

    def wait_for(self, key: str, value: str | None = None, *, after: int = 0,
                 timeout: float = 60.0) -> int:
        """The index of the first message from ``after`` on that sets ``key`` (to ``value``);
        raises AssertionError with every message seen after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, m in enumerate(self.snapshot()[after:], after):
                if key in m and (value is None or m[key] == value):
                    return i
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} in {timeout} s; got {self.snapshot()}")

    def close(self) -> None:
        self._closed = True
        self._thread.join(2)
        self.sock.close()
        if not self.address.startswith("@"):
            os.unlink(self.address)
        os.rmdir(self._dir)

    def __enter__(self) -> "NotifyListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
