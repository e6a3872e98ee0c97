"""The PowerFS process: libfuse (through mfusepy) in front of a `PowerModel`, plus a control line.

Run by `PowerFS.mount` as ``python -m tests.crash.powerfs_server BACKING MNT STORE``. Protocol on
stdin/stdout, one JSON object a line:

- the server writes ``{"ready": true}`` once libfuse has called ``init`` (the kernel finished
  the FUSE handshake, so the mount answers), or exits non-zero with the reason on stderr;
- the parent sends ``{"op": "cut", "mode": "lose"|"torn"|"clean", "seed": N}``,
  ``{"op": "stats"}`` or ``{"op": "check"}``; each gets one reply line ``{"ok": ..., ...}``;
- EOF on stdin (the parent died) cuts the power in ``lose`` mode and unmounts, so a crashed
  test run leaves no mount behind. An unmount that was not preceded by a cut does the same.

Every FS call runs under one lock; libfuse runs single-threaded (``-s``), so calls arrive in the
order the kernel sent them. An exception other than an errno the model raised on purpose is a
harness bug: it is answered EIO, logged, and reported by ``stats``/``cut`` in ``errors``.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # mfusepy prefers libfuse2 when both exist
import mfusepy  # noqa: E402

from tests.crash.powerfs_model import DirNode, FileNode, FsError, PowerModel  # noqa: E402

log = logging.getLogger("powerfs.server")


def _op(method):
    """Run one FS call under the lock; unexpected exceptions become EIO and are recorded."""
    @functools.wraps(method)
    def wrapper(self: PowerOps, *args):
        with self.mutex:
            try:
                return method(self, *args)
            except FsError:
                raise
            except Exception as exc:  # noqa: BLE001 - every harness bug must reach the test
                log.exception("powerfs internal error op=%s args=%.200r", method.__name__, args)
                self.errors.append(f"{method.__name__}: {type(exc).__name__}: {exc}")
                raise FsError(errno.EIO, f"internal error in {method.__name__}") from exc
    return wrapper


class PowerOps(mfusepy.Operations):
    """The mfusepy high-level operations, each a thin call into the model."""

    use_ns = True
    flag_nopath = True  # with flag_nullpath_ok: calls on unlinked open files get path None
    flag_nullpath_ok = True

    def __init__(self, model: PowerModel, ready: threading.Event) -> None:
        self.model = model
        self.mutex = threading.Lock()
        self.errors: list[str] = []
        self._ready = ready

    def init(self, path: str) -> None:
        self._ready.set()

    @_op
    def getattr(self, path: str | None, fh: int | None = None) -> dict:
        node = self.model.node_of(path, fh)
        common = dict(st_ino=node.ino, st_uid=node.uid, st_gid=node.gid, st_atime=node.atime_ns,
                      st_mtime=node.mtime_ns, st_ctime=node.ctime_ns, st_blksize=4096)
        if isinstance(node, DirNode):
            nlink = 2 + sum(isinstance(c, DirNode) for c in node.live.values())
            return dict(common, st_mode=stat.S_IFDIR | node.mode, st_nlink=nlink, st_size=4096)
        assert isinstance(node, FileNode)
        return dict(common, st_mode=stat.S_IFREG | node.mode, st_nlink=1 if node.parent else 0,
                    st_size=node.live_size, st_blocks=(node.live_size + 511) // 512)

    @_op
    def access(self, path: str, amode: int) -> int:
        self.model.lookup(path)
        return 0

    @_op
    def opendir(self, path: str) -> int:
        node = self.model.lookup(path)
        if not isinstance(node, DirNode):
            raise FsError(errno.ENOTDIR, path)
        return self.model._handle(node, os.O_RDONLY)

    @_op
    def readdir(self, path: str | None, fh: int) -> list[str]:
        node = self.model.node_of(path, fh)
        if not isinstance(node, DirNode):
            raise FsError(errno.ENOTDIR, str(path))
        return [".", "..", *sorted(node.live)]

    @_op
    def releasedir(self, path: str | None, fh: int) -> int:
        self.model.release(fh)
        return 0

    @_op
    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self.model.fsyncdir(path, datasync, fh)
        return 0

    @_op
    def mkdir(self, path: str, mode: int) -> int:
        uid, gid, _ = mfusepy.fuse_get_context()
        self.model.mkdir(path, mode, uid, gid)
        return 0

    @_op
    def rmdir(self, path: str) -> int:
        self.model.rmdir(path)
        return 0

    @_op
    def unlink(self, path: str) -> int:
        self.model.unlink(path)
        return 0

    @_op
    def rename(self, old: str, new: str, flags: int = 0) -> int:
        self.model.rename(old, new, flags)
        return 0

    @_op
    def link(self, target: str, source: str) -> int:
        raise FsError(errno.EOPNOTSUPP, "powerfs has no hard links")

    @_op
    def symlink(self, target: str, source: str) -> int:
        raise FsError(errno.EOPNOTSUPP, "powerfs has no symlinks")

    @_op
    def mknod(self, path: str, mode: int, dev: int) -> int:
        raise FsError(errno.EOPNOTSUPP, "powerfs has only files and directories")

    @_op
    def chmod(self, path: str | None, mode: int, fh: int | None = None) -> int:
        self.model.node_of(path, fh).mode = mode & 0o7777
        return 0

    @_op
    def chown(self, path: str | None, uid: int, gid: int, fh: int | None = None) -> int:
        node = self.model.node_of(path, fh)
        node.uid = node.uid if uid in (-1, 0xFFFFFFFF) else uid
        node.gid = node.gid if gid in (-1, 0xFFFFFFFF) else gid
        return 0

    @_op
    def utimens(self, path: str | None, times: tuple[int, int] | None = None,
                fh: int | None = None) -> int:
        node = self.model.node_of(path, fh)
        now = time.time_ns()
        node.atime_ns, node.mtime_ns = times if times else (now, now)
        return 0

    @_op
    def statfs(self, path: str) -> dict:
        st = os.statvfs(self.model.store)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree",
                                             "f_bavail", "f_files", "f_ffree", "f_favail",
                                             "f_namemax")}

    @_op
    def create(self, path: str, mode: int, flags: int) -> int:
        uid, gid, _ = mfusepy.fuse_get_context()
        return self.model.create(path, mode, flags, uid, gid)

    @_op
    def open(self, path: str, flags: int) -> int:
        return self.model.open(path, flags)

    @_op
    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return self.model.read(path, size, offset, fh)

    @_op
    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        return self.model.write(path, data, offset, fh)

    @_op
    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        self.model.truncate(path, length, fh)
        return 0

    @_op
    def fallocate(self, path: str | None, mode: int, offset: int, size: int, fh: int) -> int:
        self.model.fallocate(path, mode, offset, size, fh)
        return 0

    @_op
    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self.model.fsync(path, datasync, fh)
        return 0

    @_op
    def flush(self, path: str | None, fh: int) -> int:
        return 0

    @_op
    def release(self, path: str | None, fh: int) -> int:
        self.model.release(fh)
        return 0


class _FUSE(mfusepy.FUSE):
    """mfusepy's FUSE with the handle passed on where mfusepy 3.1.1 drops it.

    With ``nullpath_ok`` libfuse gives no path to truncate/chmod/chown/utimens on an open
    handle (ftruncate, fchmod, futimens), and mfusepy does not pass the handle either; rename
    also loses its flags (RENAME_NOREPLACE) there.
    """

    def _path(self, path: bytes | None) -> str | None:
        return None if path is None else path.decode(self.encoding, self.errors)

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return self.operations.rename(self._path(old), self._path(new), flags)

    def truncate_fuse_3(self, path, length: int, fip) -> int:
        return self.operations.truncate(self._path(path), length, fip.contents.fh if fip else None)

    def chmod_fuse_3(self, path, mode: int, fip) -> int:
        return self.operations.chmod(self._path(path), mode, fip.contents.fh if fip else None)

    def chown_fuse_3(self, path, uid: int, gid: int, fip) -> int:
        return self.operations.chown(self._path(path), uid, gid, fip.contents.fh if fip else None)

    def utimens_fuse_3(self, path, buf, fip) -> int:
        times = None
        if buf:
            times = (mfusepy.time_of_timespec(buf.contents.actime, use_ns=True),
                     mfusepy.time_of_timespec(buf.contents.modtime, use_ns=True))
        return self.operations.utimens(self._path(path), times, fip.contents.fh if fip else None)


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _control(ops: PowerOps, backing: Path, mnt: str, ready: threading.Event) -> None:
    """Serve control lines until EOF; on EOF cut (lose) if not cut yet, and unmount."""
    ready.wait()
    _reply({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            with ops.mutex:
                if req["op"] == "cut":
                    report = ops.model.cut(req["mode"], int(req["seed"]), backing)
                    _reply({"ok": True, "report": asdict(report), "errors": ops.errors})
                elif req["op"] == "stats":
                    dirty = sum(len(f.dirty) for f in ops.model.files.values())
                    _reply({"ok": True, "counters": ops.model.counters, "dirty_pages": dirty,
                            "errors": ops.errors})
                elif req["op"] == "check":
                    ops.model.check_invariants()
                    _reply({"ok": True, "errors": ops.errors})
                else:
                    _reply({"ok": False, "error": f"unknown op {req['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
            log.exception("powerfs control request failed req=%r", req)
            _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    with ops.mutex:
        if not ops.model.dead:
            log.warning("powerfs: control channel closed before a power cut; cutting (lose)")
            ops.model.cut("lose", 0, backing)
    subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)


def main(argv: list[str]) -> int:
    backing, mnt, store = Path(argv[0]), argv[1], Path(argv[2])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model = PowerModel(store)
    model.import_tree(backing)
    ready = threading.Event()
    ops = PowerOps(model, ready)
    threading.Thread(target=_control, args=(ops, backing, mnt, ready), daemon=True).start()
    # Single-threaded (-s), no kernel data cache across opens, writeback cache and direct_io off
    # (libfuse 3 defaults): every write(2) and every written-back mmap page is one WRITE call.
    try:
        _FUSE(ops, mnt, foreground=True, nothreads=True, hard_remove=True, fsname="powerfs")
    finally:
        with ops.mutex:
            if not model.dead:
                log.warning("powerfs: unmounted before a power cut; cutting (lose)")
                model.cut("lose", 0, backing)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
