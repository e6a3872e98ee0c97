"""The nodes of the PowerFS model, its errors, and what a power cut reports.

A `Node` has the fields every node has; a `DirNode` holds two name -> node maps, ``live`` and
``durable``. Files are `powerfs_file.FileNode`, which also owns the file's bytes (a store file
under an overlay of dirty pages). `powerfs_model` states the tree's invariants and the
durability rules.
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
    """A directory: ``live`` is what lookups and readdir see, ``durable`` what a cut keeps."""

    live: dict[str, Node] = field(default_factory=dict)
    durable: dict[str, Node] = field(default_factory=dict)

    def link(self, name: str, node: Node) -> None:
        """Enter `node` under `name` in the live map; that entry becomes its live link."""
        self.live[name] = node
        node.parent, node.name = self, name
        self.mtime_ns = time.time_ns()

    def unlink(self, name: str) -> Node:
        """Drop `name` from the live map; the node loses its live link if it was this entry."""
        node = self.live.pop(name)
        if node.parent is self and node.name == name:
            node.parent, node.name = None, ""
        self.mtime_ns = time.time_ns()
        return node

    def sync(self) -> None:
        """The whole live map becomes the durable map (each child's ``durable_links`` follow)."""
        for child in self.durable.values():
            child.durable_links -= 1
        self.durable = dict(self.live)
        for child in self.durable.values():
            child.durable_links += 1


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
