"""Watching the config file (the ``watchdog`` package: inotify on Linux) for a reload.

The watch is on the file's directory, not the file: editors and config managers save by
writing a new file and renaming it over the old one, which a watch on the old inode would
miss. Every event that names the file (created, modified, moved onto it, deleted) calls
``on_change`` on the event loop's thread; ``Reloader.request`` coalesces the burst one save
makes. A symlinked file is watched at both ends (the link's directory and the target's).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

log = logging.getLogger(__name__)

_IGNORED = ("opened", "closed_no_write")  # reads (ours included) change nothing


class _Handler(FileSystemEventHandler):
    def __init__(self, paths: set[str], notify: Callable[[], None]) -> None:
        self.paths = paths
        self.notify = notify

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _IGNORED or event.is_directory:
            return
        names = {os.fsdecode(event.src_path), os.fsdecode(getattr(event, "dest_path", "") or "")}
        if names & self.paths:
            self.notify()


class ConfigWatch:
    """Calls ``on_change("file changed")`` on ``loop`` whenever ``path`` may have changed.

    Invariants: the observer thread runs between ``start`` and ``stop``; it never touches
    daemon state itself (``call_soon_threadsafe`` hands every event to the loop).
    """

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop,
                 on_change: Callable[[str], None]) -> None:
        self.path = os.path.abspath(path)
        self.loop = loop
        self.on_change = on_change
        self._observer = None

    def start(self) -> None:
        """Begin watching; an error (no such directory, inotify limits) is logged, and the
        daemon serves without a watch (SIGHUP still reloads)."""
        paths = {self.path, os.path.realpath(self.path)}
        handler = _Handler(paths, self._notify)
        observer = Observer()
        try:
            for directory in sorted({os.path.dirname(p) for p in paths}):
                observer.schedule(handler, directory, recursive=False)
            observer.start()
        except OSError as exc:
            log.error("cannot watch the config file, reload with SIGHUP (systemctl reload "
                      "prefixd) path=%s error=%r", self.path, exc)
            return
        self._observer = observer
        log.info("watching the config file path=%s", self.path)

    def _notify(self) -> None:  # on the observer's thread
        try:
            self.loop.call_soon_threadsafe(self.on_change, "file changed")
        except RuntimeError:  # the loop closed under us: the daemon is stopping
            pass

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(5.0)
            self._observer = None
