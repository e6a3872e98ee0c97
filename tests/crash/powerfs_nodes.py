"""The nodes of the PowerFS model, its errors, and what a power cut reports.

A `DirNode` holds two name -> node maps, ``live`` and ``durable``; a `FileNode` holds its durable
bytes in a store file (``fd``, exactly ``durable_size`` long) and its unsynced writes in
``dirty`` (whole 4 KiB pages). `powerfs_model` states the invariants and the durability rules.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

PAGE_SIZE = 4096
MODES = ("lose", "torn", "clean")


class PowerFSError(Exception):
    """A harness failure (bad state, bad request, a mount that did not come up), with context."""


class FsError(OSError):
    """An errno to hand back to the kernel for one FS call (ENOENT, ENOTEMPTY, ...)."""

    def __init__(self, code: int, what: str) -> None:
        super().__init__(code, f"{os.strerror(code)}: {what}")


@dataclass(eq=False)
class Node:
    """Fields every node has; ``parent``/``name`` are the live link (None when unlinked)."""

    ino: int
    mode: int
    parent: DirNode | None = None
    name: str = ""
    durable_links: int = 0
    uid: int = 0
    gid: int = 0
    atime_ns: int = field(default_factory=time.time_ns)
    mtime_ns: int = field(default_factory=time.time_ns)
    ctime_ns: int = field(default_factory=time.time_ns)


@dataclass(eq=False)
class DirNode(Node):
    live: dict[str, Node] = field(default_factory=dict)
    durable: dict[str, Node] = field(default_factory=dict)


@dataclass(eq=False)
class FileNode(Node):
    fd: int = -1  # the store file, O_RDWR
    durable_size: int = 0
    live_size: int = 0
    floor: int = 0
    dirty: dict[int, bytearray] = field(default_factory=dict)


@dataclass(frozen=True)
class CutReport:
    """What a power cut kept and dropped (counts over durable files; `lost_entries` over dirs)."""

    mode: str
    seed: int
    num_files: int
    num_dirs: int
    pages_kept: int
    pages_lost: int
    sizes_kept: int
    sizes_lost: int
    lost_entries: int
