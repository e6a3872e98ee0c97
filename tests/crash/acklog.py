"""Ack logs: what a workload child acknowledged, kept outside the simulated disk.

A workload appends one line per acknowledged item *after* the operation it acknowledges returned
(for prefixd: after a Commit at ``power`` level answered). The file lives on the real disk, next
to the PowerFS root and not under ``fs.mnt``, so it survives the power cut that the test process
simulates. Lines are written with one ``write(2)`` on an ``O_APPEND`` descriptor, so a SIGKILL
leaves whole lines and at most one torn last line, which `read_acks` drops (the item it names
was not acknowledged yet from the test's point of view).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class AckLog:
    """Append-only writer of ack lines (no newline inside a record)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def ack(self, record: str) -> None:
        if "\n" in record:
            raise ValueError(f"an ack record cannot hold a newline: {record!r}")
        data = (record + "\n").encode()
        if os.write(self._fd, data) != len(data):
            raise OSError(f"short write to ack log {self.path}")

    def close(self) -> None:
        os.close(self._fd)


def read_acks(path: str | os.PathLike) -> list[str]:
    """Every whole line of the ack log, in order (a missing file is no acks)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return data.decode().split("\n")[:-1]


def wait_for_acks(path: str | os.PathLike, count: int, *, timeout_s: float = 30.0,
                  proc=None) -> list[str]:
    """Poll until the log holds `count` acks (or `proc` exited); return what it holds.

    Raises:
        TimeoutError: fewer than `count` acks after `timeout_s`, naming the count seen.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        acks = read_acks(path)
        if len(acks) >= count or (proc is not None and proc.poll() is not None):
            return acks
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: {len(acks)} of {count} acks after {timeout_s} s")
        time.sleep(0.005)
