"""The power cut: turn a `PowerModel` into the directory tree a disk would hold afterwards.

The durable tree (every ``durable`` map from the root) is written into an empty backing
directory: directories are made, each file's store file is finished per mode and renamed into
place (no data is copied), a file reached under two durable names gets a hard link. Modes:
``lose`` keeps the store file as it is; ``torn`` tears it (`_tear`, rules in `powerfs_model`);
``clean`` syncs everything first. Afterwards the model is dead (every call EIO) and its store
directory is gone.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tests.crash.powerfs_file import FileNode
from tests.crash.powerfs_nodes import MODES, PAGE_SIZE, CutReport, DirNode, PowerFSError

if TYPE_CHECKING:
    from tests.crash.powerfs_model import PowerModel


def power_cut(model: PowerModel, mode: str, seed: int, backing: Path) -> CutReport:
    """Power off: drop what is not durable (per `mode`), write the durable tree to `backing`.

    Raises:
        PowerFSError: unknown mode, or the model was already cut.
    """
    if mode not in MODES:
        raise PowerFSError(f"power cut mode {mode!r} is not one of {MODES}")
    if model.dead:
        raise PowerFSError("power was already cut")
    if mode == "clean":
        model.sync_all()
    model.dead = True
    counts = dict(files=0, dirs=0, kept=0, lost=0, sizes_kept=0, sizes_lost=0, entries=0)
    placed: dict[int, Path] = {}

    def walk(dnode: DirNode, target: Path, rel: str) -> None:
        counts["dirs"] += 1
        counts["entries"] += sum(1 for n, c in dnode.live.items() if dnode.durable.get(n) is not c)
        for name in sorted(dnode.durable):
            child, dest, child_rel = dnode.durable[name], target / name, f"{rel}/{name}"
            if isinstance(child, DirNode):
                os.mkdir(dest)
                walk(child, dest, child_rel)
                os.chmod(dest, child.mode)
                continue
            assert isinstance(child, FileNode)
            if child.ino in placed:
                os.link(placed[child.ino], dest)
                continue
            counts["files"] += 1
            if mode == "torn":
                _tear(child, random.Random(f"{seed}:{child_rel}"), counts)
            else:
                counts["lost"] += len(child.dirty)
                counts["sizes_lost"] += (child.live_size != child.durable_size
                                         or child.floor < child.durable_size)
            os.close(child.fd)
            child.fd = -1
            os.rename(model.store / str(child.ino), dest)
            os.chmod(dest, child.mode)
            os.utime(dest, ns=(child.atime_ns, child.mtime_ns))
            placed[child.ino] = dest

    walk(model.root, Path(backing), "")
    for node in model.files.values():
        if node.fd >= 0:
            os.close(node.fd)
            node.fd = -1
    model.handles.clear()
    shutil.rmtree(model.store, ignore_errors=True)
    return CutReport(mode=mode, seed=seed, num_files=counts["files"], num_dirs=counts["dirs"],
                     pages_kept=counts["kept"], pages_lost=counts["lost"],
                     sizes_kept=counts["sizes_kept"], sizes_lost=counts["sizes_lost"],
                     lost_entries=counts["entries"])


def _tear(node: FileNode, rng: random.Random, counts: dict[str, int]) -> None:
    """Torn mode for one file: one coin for the size change, then one per dirty page in order."""
    size = node.durable_size
    if node.live_size != node.durable_size or node.floor < node.durable_size:
        if rng.random() < 0.5:
            os.ftruncate(node.fd, node.floor)
            size = node.live_size
            counts["sizes_kept"] += 1
        else:
            counts["sizes_lost"] += 1
    os.ftruncate(node.fd, size)
    for idx in sorted(node.dirty):
        keep = rng.random() < 0.5
        start = idx * PAGE_SIZE
        if keep and start < size:
            os.pwrite(node.fd, bytes(node.dirty[idx][: min(PAGE_SIZE, size - start)]), start)
        counts["kept" if keep else "lost"] += 1
