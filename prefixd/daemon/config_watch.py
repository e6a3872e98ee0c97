"""Watching the config file (Linux inotify, read on the event loop) for a reload.

The watch is on the file's directory, not the file: editors and config managers save by
writing a new file and renaming it over the old one, which a watch on the old inode would
miss. Every event that names the file (created, written, moved onto it or away, deleted)
calls ``on_change`` on the event loop; ``Reloader.request`` coalesces the burst one save
makes. A symlinked file is watched at both ends (the link's directory and the target's).

NOTE: the inotify descriptor is read by the event loop itself (``add_reader``), not by a
thread: ``stop`` removes the reader and closes the descriptor on the loop's thread, so no
read can race the close. The ``watchdog`` package's observer thread did race its own stop
(``ERROR ... InotifyEmitter.queue_events() called when the thread is inactive``, about one
stop in seven), which pages whoever watches the logs.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct
from typing import Callable

log = logging.getLogger(__name__)

# <sys/inotify.h>
IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x8, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_Q_OVERFLOW = 0x100, 0x200, 0x4000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of NUL-padded name)


class ConfigWatch:
    """Calls ``on_change("file changed")`` on ``loop`` whenever ``path`` may have changed.

    Invariants: between ``start`` and ``stop`` the loop reads one inotify descriptor; every
    call to ``on_change`` and the close of the descriptor happen on the loop's thread.
    """

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop,
                 on_change: Callable[[str], None]) -> None:
        self.path = os.path.abspath(path)
        self.loop = loop
        self.on_change = on_change
        self._fd = -1
        self._names: dict[int, set[bytes]] = {}  # watch descriptor -> file names that count

    def start(self) -> None:
        """Begin watching; an error (no such directory, inotify limits) is logged, and the
        daemon serves without a watch (SIGHUP still reloads)."""
        paths = {self.path, os.path.realpath(self.path)}
        try:
            fd = _inotify_init()
        except OSError as exc:
            self._cannot_watch(exc)
            return
        try:
            for directory in sorted({os.path.dirname(p) for p in paths}):
                wd = _add_watch(fd, directory)
                self._names.setdefault(wd, set()).update(
                    os.fsencode(os.path.basename(p)) for p in paths if os.path.dirname(p) == directory)
            self.loop.add_reader(fd, self._read)
        except OSError as exc:
            os.close(fd)
            self._names.clear()
            self._cannot_watch(exc)
            return
        self._fd = fd
        log.info("watching the config file path=%s", self.path)

    def _cannot_watch(self, exc: OSError) -> None:
        log.error("cannot watch the config file, reload with SIGHUP (systemctl reload "
                  "prefixd) path=%s error=%r", self.path, exc)

    def _read(self) -> None:  # on the loop, when the descriptor is readable
        try:
            data = os.read(self._fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        changed = False
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _, size = _HEADER.unpack_from(data, offset)
            name = data[offset + _HEADER.size: offset + _HEADER.size + size].rstrip(b"\0")
            offset += _HEADER.size + size
            if mask & IN_Q_OVERFLOW or name in self._names.get(wd, ()):
                changed = True  # an overflow may have dropped one naming the file
        if changed:
            self.on_change("file changed")

    def stop(self) -> None:
        """Stop watching (on the loop's thread; idempotent)."""
        if self._fd >= 0:
            self.loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._names.clear()


_libc = None


def _call(name: str, *args) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    result = getattr(_libc, name)(*args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")
    return result


def _inotify_init() -> int:
    return _call("inotify_init1", IN_NONBLOCK | IN_CLOEXEC)


def _add_watch(fd: int, directory: str) -> int:
    if not os.path.isdir(directory):
        raise OSError(errno.ENOENT, f"no directory {directory}")
    return _call("inotify_add_watch", fd, os.fsencode(directory), ctypes.c_uint32(_MASK))
