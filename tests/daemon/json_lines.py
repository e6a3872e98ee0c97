"""Append-only files of JSON lines, the channel from the load clients to their checkers: each
client process writes its ``acks-INDEX`` and ``events-INDEX`` with a ``Log``, and the test
reads them with ``read_lines`` (once) or a ``LineTail`` (as they grow). A client killed
mid-write leaves whole lines and at most one torn last line, which the readers leave out.
"""

from __future__ import annotations

import json
import os


class Log:
    """One JSON object per line, one ``write(2)`` on an O_APPEND descriptor (a kill leaves
    whole lines and at most one torn last line, which ``read_lines`` drops)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(self, obj: dict) -> None:
        os.write(self._fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())


def read_lines(path: str) -> list[dict]:
    try:
        with open(path, "rb") as f:
            data = f.read().decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data.split("\n")[:-1]]


class LineTail:
    """``read_lines`` of one append-only file, read incrementally: each ``read`` decodes only the
    whole lines appended since the last one (a partial last line waits for its newline).

    NOTE: the kill -9 soak polls every client's acks every 20 ms; re-reading whole files is
    quadratic (by the 70th of 100 kills, about 105k lines re-parsed per poll, with a kill every
    2-3 min).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.lines: list[dict] = []

    def read(self) -> list[dict]:
        """Every whole line so far, decoded (a new list: callers keep snapshots)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return list(self.lines)
        end = data.rfind(b"\n")
        if end >= 0:
            self.lines.extend(json.loads(line) for line in data[:end].split(b"\n"))
            self.offset += end + 1
        return list(self.lines)
