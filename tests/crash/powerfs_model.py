"""The durability model behind PowerFS: what processes see versus what a disk would still hold.

Data structure. A tree of `DirNode` / `FileNode` objects held in memory by the FS process.

- Every file's *durable* bytes live in one store file, ``store/<ino>``; its unsynced writes live
  in an overlay of dirty 4 KiB pages. `powerfs_file.FileNode` owns both and states what a read
  sees; this model resolves paths and handles to nodes, counts calls, and applies the rules
  below.
- Every directory has two entry maps: ``live`` (what `readdir` and path lookups see) and
  ``durable`` (what would be found after a power cut). Both map a name to a node object.

Invariants (`check_invariants`):

- Every file's own invariants (`FileNode.check_invariants`): ``floor <= min(durable_size,
  live_size)``, no dirty byte past ``live_size``, the store file exactly ``durable_size`` bytes.
- A node's ``parent``/``name`` are its live link (``None`` once unlinked); ``durable_links``
  counts the durable maps that hold it.

Durability rules (conservative, close to ext4 ``data=ordered`` with ``auto_da_alloc`` off, and
never relying on the implicit ordering that ext4's single journal gives):

1. Data and size of a file become durable on fsync or fdatasync of that file (any handle): the
   whole file, every dirty page and the current size (fdatasync makes the size durable too, as
   Linux does when the size is needed to read the data back). A write through a handle opened
   ``O_SYNC``/``O_DSYNC`` makes the pages it wrote (and the size) durable before it returns.
2. Creation: fsync of a file or directory whose node is in no durable directory yet makes its
   current live name durable in its parent (replacing whatever that durable name held), and
   the same, recursively, for parent directories that are not durable yet.
3. Every other namespace change (rename, unlink, rmdir, and a creation no fsync has covered)
   becomes durable only on fsync of the directory that holds the entry: fsync of a directory
   copies its whole ``live`` map to ``durable``. A rename across directories needs both fsynced
   (with only the target fsynced, the file is durable under both names).
4. Attributes other than the size (mode, owner, times) are not modelled: they are materialized
   as last set.

Power cut (`cut`): the namespace keeps only durable entries in both modes. File data:

- ``lose``: every file is its store file: every unsynced write and size change is gone.
- ``torn``: per file, one seeded coin decides whether the unsynced size change (truncate and
  extension) happened; then each dirty page is independently kept (new bytes) or lost (old
  bytes) by a seeded coin. When the size change happened, a lost page past the lowest size
  since the last sync reads as zeros (the truncate landed, the write after it did not). Coins
  are drawn from ``random.Random(f"{seed}:{path}")`` in page order, so one seed and one
  sequence of writes always give the same result.
- ``clean``: an orderly unmount: everything live is synced first (nothing is lost).

NOTE: the model serves one caller at a time (the FS process runs libfuse single-threaded and
takes a lock around every call); it is not thread-safe by itself.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from tests.crash.powerfs_cut import power_cut
from tests.crash.powerfs_file import FileNode
from tests.crash.powerfs_nodes import (  # noqa: F401 - re-exported for the harness
    MODES,
    PAGE_SIZE,
    CutReport,
    DirNode,
    FsError,
    Node,
    PowerFSError,
)


class PowerModel:
    """The tree, the open handles and the counters of one mounted PowerFS (see module doc)."""

    def __init__(self, store: Path) -> None:
        self.store = Path(store)
        self.store.mkdir(parents=True, exist_ok=False)
        self._next_ino = 1
        self.root = DirNode(ino=self._new_ino(), mode=0o755)
        self.handles: dict[int, tuple[Node, int]] = {}  # fh -> (node, open flags)
        self.files: dict[int, FileNode] = {}  # every file ever made, live or not: fds to close
        self._next_fh = 1
        self.dead = False  # set by cut(): every later call fails with EIO
        self.counters = {k: 0 for k in ("write", "write_sync", "fsync", "fdatasync", "fsyncdir",
                                        "read", "truncate", "fallocate", "rename", "unlink")}

    # ---- setup -------------------------------------------------------------------------

    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def _new_file(self, mode: int) -> FileNode:
        node = FileNode(ino=self._new_ino(), mode=mode & 0o7777)
        node.fd = os.open(self.store / str(node.ino), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.files[node.ino] = node
        return node

    def import_tree(self, backing: Path) -> None:
        """Take `backing` as fully durable: move its files into the store, then empty it.

        Raises:
            PowerFSError: for anything but regular files and directories (symlinks, devices).
        """
        def walk(src: Path, dnode: DirNode) -> None:
            for entry in sorted(os.scandir(src), key=lambda e: e.name):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    child: Node = DirNode(ino=self._new_ino(), mode=st.st_mode & 0o7777)
                    walk(Path(entry.path), child)  # type: ignore[arg-type]
                elif stat.S_ISREG(st.st_mode):
                    child = FileNode(ino=self._new_ino(), mode=st.st_mode & 0o7777,
                                     durable_size=st.st_size, live_size=st.st_size,
                                     floor=st.st_size)
                    target = self.store / str(child.ino)
                    os.rename(entry.path, target)
                    child.fd = os.open(target, os.O_RDWR)
                    self.files[child.ino] = child
                else:
                    raise PowerFSError(f"powerfs backs only files and directories, not {entry.path!r}")
                child.uid, child.gid = st.st_uid, st.st_gid
                child.atime_ns, child.mtime_ns = st.st_atime_ns, st.st_mtime_ns
                child.parent, child.name, child.durable_links = dnode, entry.name, 1
                dnode.live[entry.name] = dnode.durable[entry.name] = child
        walk(Path(backing), self.root)
        for entry in os.scandir(backing):
            shutil.rmtree(entry.path)

    # ---- lookup and handles ------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead:
            raise FsError(errno.EIO, "power is off")

    def lookup(self, path: str) -> Node:
        self._check_alive()
        node: Node = self.root
        for part in (p for p in path.split("/") if p):
            if not isinstance(node, DirNode):
                raise FsError(errno.ENOTDIR, path)
            child = node.live.get(part)
            if child is None:
                raise FsError(errno.ENOENT, path)
            node = child
        return node

    def node_of(self, path: str | None, fh: int | None) -> Node:
        """The node behind a handle when there is one (it may be unlinked), else the path's."""
        self._check_alive()
        if fh:
            entry = self.handles.get(fh)
            if entry is None:
                raise FsError(errno.EBADF, f"fh {fh}")
            return entry[0]
        if path is None:
            raise FsError(errno.EBADF, "no path and no handle")
        return self.lookup(path)

    def _file(self, path: str | None, fh: int | None) -> FileNode:
        node = self.node_of(path, fh)
        if not isinstance(node, FileNode):
            raise FsError(errno.EISDIR, str(path))
        return node

    def _split(self, path: str) -> tuple[DirNode, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self.lookup(head or "/")
        if not isinstance(parent, DirNode):
            raise FsError(errno.ENOTDIR, path)
        if not name:
            raise FsError(errno.EINVAL, path)
        return parent, name

    def open(self, path: str, flags: int) -> int:
        node = self.lookup(path)
        return self._handle(node, flags)

    def _handle(self, node: Node, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = (node, flags)
        return fh

    def release(self, fh: int) -> None:
        self.handles.pop(fh, None)

    # ---- namespace ---------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int, uid: int = 0, gid: int = 0) -> int:
        parent, name = self._split(path)
        if name in parent.live:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST, path)
            return self.open(path, flags)
        node = self._new_file(mode)
        node.uid, node.gid = uid, gid
        parent.link(name, node)
        return self._handle(node, flags)

    def mkdir(self, path: str, mode: int, uid: int = 0, gid: int = 0) -> None:
        parent, name = self._split(path)
        if name in parent.live:
            raise FsError(errno.EEXIST, path)
        node = DirNode(ino=self._new_ino(), mode=mode & 0o7777, uid=uid, gid=gid)
        parent.link(name, node)

    def unlink(self, path: str) -> None:
        parent, name = self._split(path)
        node = parent.live.get(name)
        if node is None:
            raise FsError(errno.ENOENT, path)
        if isinstance(node, DirNode):
            raise FsError(errno.EISDIR, path)
        self.counters["unlink"] += 1
        parent.unlink(name)

    def rmdir(self, path: str) -> None:
        parent, name = self._split(path)
        node = parent.live.get(name)
        if node is None:
            raise FsError(errno.ENOENT, path)
        if not isinstance(node, DirNode):
            raise FsError(errno.ENOTDIR, path)
        if node.live:
            raise FsError(errno.ENOTEMPTY, path)
        parent.unlink(name)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        """rename(2) with RENAME_NOREPLACE (1); RENAME_EXCHANGE and others are EINVAL."""
        if flags & ~1:
            raise FsError(errno.EINVAL, f"rename flags {flags:#x}")
        src_dir, src_name = self._split(old)
        dst_dir, dst_name = self._split(new)
        node = src_dir.live.get(src_name)
        if node is None:
            raise FsError(errno.ENOENT, old)
        walk: DirNode | None = dst_dir
        while walk is not None:
            if walk is node:
                raise FsError(errno.EINVAL, f"{old} -> {new}: into itself")
            walk = walk.parent
        target = dst_dir.live.get(dst_name)
        if target is node:
            return
        if target is not None:
            if flags & 1:
                raise FsError(errno.EEXIST, new)
            if isinstance(target, DirNode):
                if not isinstance(node, DirNode):
                    raise FsError(errno.EISDIR, new)
                if target.live:
                    raise FsError(errno.ENOTEMPTY, new)
            elif isinstance(node, DirNode):
                raise FsError(errno.ENOTDIR, new)
            dst_dir.unlink(dst_name)
        self.counters["rename"] += 1
        src_dir.unlink(src_name)
        dst_dir.link(dst_name, node)

    # ---- data --------------------------------------------------------------------------

    def read(self, path: str | None, size: int, offset: int, fh: int | None) -> bytes:
        node = self._file(path, fh)
        self.counters["read"] += 1
        return node.read(size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fh: int | None) -> int:
        node = self._file(path, fh)
        self.counters["write"] += 1
        pages = node.write(data, offset)
        flags = self.handles[fh][1] if fh in self.handles else 0
        if flags & (os.O_SYNC | os.O_DSYNC):
            self.counters["write_sync"] += 1
            self._sync_pages(node, pages)
        return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None) -> None:
        node = self._file(path, fh)
        self.counters["truncate"] += 1
        node.resize(length)

    def fallocate(self, path: str | None, mode: int, offset: int, length: int, fh: int | None) -> None:
        """Mode 0 extends the size (zeros read back); KEEP_SIZE (1) is a no-op; PUNCH_HOLE |
        KEEP_SIZE (3) zeroes the range inside the file, like a write of zeros (durable at the
        next fsync; a cut before it may keep the old bytes); others ENOTSUP."""
        node = self._file(path, fh)
        self.counters["fallocate"] += 1
        if mode == 0:
            if offset + length > node.live_size:
                node.resize(offset + length)
        elif mode == 3:
            node.punch(offset, length)
        elif mode != 1:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x}")

    # ---- durability --------------------------------------------------------------------

    def _sync_pages(self, node: FileNode, pages) -> None:
        """Rule 1 for an O_DSYNC write: the written pages and the size reach the store."""
        if node.floor < node.durable_size:
            self.fsync(None, 1, None, node=node)  # a pending truncate must land first
            return
        node.sync_pages(pages)
        self._make_reachable(node)

    def fsync(self, path: str | None, datasync: int, fh: int | None, *, node: Node | None = None) -> None:
        """Rules 1 and 2: a file's data and size, and its creation, become durable."""
        node = node or self.node_of(path, fh)
        if isinstance(node, DirNode):
            self.fsyncdir(None, datasync, None, node=node)
            return
        assert isinstance(node, FileNode)
        self.counters["fdatasync" if datasync else "fsync"] += 1
        node.sync()
        self._make_reachable(node)

    def fsyncdir(self, path: str | None, datasync: int, fh: int | None, *, node: Node | None = None) -> None:
        """Rule 3 (the directory's whole live map becomes durable), then rule 2 for the dir."""
        node = node or self.node_of(path, fh)
        if not isinstance(node, DirNode):
            raise FsError(errno.ENOTDIR, str(path))
        self.counters["fsyncdir"] += 1
        node.sync()
        self._make_reachable(node)

    def _make_reachable(self, node: Node) -> None:
        """Rule 2: a node in no durable map gets its live name made durable, up to the root."""
        while node is not self.root and node.durable_links == 0 and node.parent is not None:
            parent = node.parent
            old = parent.durable.get(node.name)
            if old is not None:
                old.durable_links -= 1
            parent.durable[node.name] = node
            node.durable_links += 1
            node = parent

    def sync_all(self) -> None:
        """Fsync every live file and directory (an orderly unmount)."""
        def walk(dnode: DirNode) -> None:
            for child in dnode.live.values():
                if isinstance(child, DirNode):
                    walk(child)
                else:
                    self.fsync(None, 0, None, node=child)
            self.fsyncdir(None, 0, None, node=dnode)
        walk(self.root)

    # ---- power cut ---------------------------------------------------------------------

    def cut(self, mode: str, seed: int, backing: Path) -> CutReport:
        """Power off into the empty `backing` (`powerfs_cut.power_cut`); then every call EIO.

        Raises:
            PowerFSError: unknown mode, or the model was already cut.
        """
        return power_cut(self, mode, seed, backing)

    # ---- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise PowerFSError naming the first broken invariant (see the module doc), the
        tree's links first, then each file's bytes."""
        links: dict[int, int] = {}
        seen: dict[int, Node] = {}

        def visit(dnode: DirNode) -> None:
            for name, child in dnode.live.items():
                if child.parent is not dnode or child.name != name:
                    raise PowerFSError(f"ino {child.ino}: live link is not {name!r}")
            for mapping in (dnode.live, dnode.durable):
                for child in mapping.values():
                    if child.ino not in seen:
                        seen[child.ino] = child
                        if isinstance(child, DirNode):
                            visit(child)
            for child in dnode.durable.values():
                links[child.ino] = links.get(child.ino, 0) + 1

        visit(self.root)
        for node in list(seen.values()) + list(self.files.values()):
            if node.durable_links != links.get(node.ino, 0):
                raise PowerFSError(f"ino {node.ino}: durable_links {node.durable_links} "
                                   f"!= {links.get(node.ino, 0)}")
            if isinstance(node, FileNode):
                node.check_invariants()
