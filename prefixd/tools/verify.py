"""``prefixctl verify --state-dir DIR``: check a stopped daemon's state directory, offline.

    python -m prefixd.tools.verify --state-dir DIR [--config FILE] [--json] [--scratch DIR]

For every pool (``DIR/pools/<tenant>/<pool>/``, or ``DIR`` itself when it is one pool's
directory) it checks, and reports instead of repairing:

1. the write-ahead log: LMDB's own structure (py-lmdb's offline verifier, ``lmdb.verify``:
   every invariant of its B-trees, key order and free pages included, more than the bounds
   walk every open makes), the checkpoint's chunks and every record after it (checksums, lsn
   order: ``prefixd.wal.reader``), the meta pages and the file's size (``WalEnv``);
2. the disk pool file: its header (magic, checksum, layout, slot count) and its length;
3. the index against the pool files: the index the log rebuilds (the engine's own recovery,
   ``verify="lazy"`` so that nothing is cut) must pass ``check_invariants``, and every disk
   block it names must match its checksum in the pool file (``TierStore.verify``).

Exit status: 0 every pool is sound; 1 damage found (each problem printed, one per line, with
the file it concerns); 2 the directory cannot be checked (no such directory, a daemon holds it).

NOTE: recovery writes (a RECOVER record, re-extending a truncated pool file, new host pool
files), so the checks run on a scratch copy of each pool's log and disk pool file, never on the
originals: verify must not repair behind the operator's back. The copy is made with
``copy_file_range`` (a reflink where the filesystem has them); verify reads every disk block
anyway, so the copy at most doubles the I/O. ``prefixctl verify`` runs this module as a child
process (the one declared exception to the client's layering, tests/test_layering.py): the
client never loads the engine, and a damaged LMDB file that kills its reader with
SIGSEGV/SIGBUS (none of the crash suite's rows does; the WAL checks sizes and pages first) is
reported by prefixctl as damage instead of killing prefixctl.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import tomllib
from typing import NamedTuple

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import DISK
from prefixd.config.engine_settings import EngineConfig, TierSizes
from prefixd.config.toml_reader import engine_config
from prefixd.engine.engine import cache_kwargs
from prefixd.engine.pool_dir import MANIFEST, POOLS_DIR
from prefixd.storage.poolfile import HEADER_BYTES, PoolHeader
from prefixd.wal.errors import StateLockedError
from prefixd.wal.lock import StateDirLock

log = logging.getLogger(__name__)

EXIT_OK, EXIT_DAMAGED, EXIT_UNCHECKED = 0, 1, 2


class Problem(NamedTuple):
    """One thing wrong: ``what`` (wal, disk_header, disk_size, disk_block, index, layout),
    the file it concerns, and a message a person can act on."""

    what: str
    path: str
    message: str


class PoolReport(NamedTuple):
    path: str
    records: int  # log records after the checkpoint, read and checked
    checked_blocks: int  # disk blocks whose checksum was read
    bad_slots: list[int]
    problems: list[Problem]


def pool_dirs(state_dir: str) -> list[str]:
    """Every pool directory of an engine state directory, or ``[state_dir]`` for a pool's own."""
    if os.path.isdir(os.path.join(state_dir, "wal")):
        return [state_dir]
    return sorted(os.path.dirname(p) for p in
                  glob.glob(os.path.join(state_dir, POOLS_DIR, "*", "*", MANIFEST)))


def _layout_and_tenant(pool: str, copy: str,
                       problems: list[Problem]) -> tuple[KVLayout | None, str | None]:
    """The pool's layout from its manifest, else its disk header, else the log's meta (read
    from the scratch ``copy``: opening the log writes)."""
    manifest = os.path.join(pool, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest, "rb") as f:
                meta = json.loads(f.read())
            return KVLayout.from_bytes(bytes.fromhex(meta["layout"])), meta["tenant"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(Problem("layout", manifest, f"manifest cannot be read: {exc}"))
    for path in glob.glob(os.path.join(pool, "*.disk.pool")):
        try:
            with open(path, "rb") as f:
                header = PoolHeader.decode(f.read(HEADER_BYTES), path)
            return KVLayout.from_bytes(header.layout_bytes), None
        except Exception:  # noqa: BLE001 - reported by the pool's own check
            pass
    try:
        from prefixd.wal.wal import Wal

        with Wal(copy, layouts=None, sync="none") as wal:
            raw = wal.meta.layouts
        if raw:
            return KVLayout.from_bytes(raw), None
    except Exception:  # noqa: BLE001 - reported by the pool's own check
        pass
    return None, None


def _disk_size_problems(pool: str) -> tuple[list[Problem], int | None]:
    """A disk pool file shorter than its header says (recovery would silently re-extend it)."""
    out, num_slots = [], None
    for path in glob.glob(os.path.join(pool, "*.disk.pool")):
        try:
            with open(path, "rb") as f:
                header = PoolHeader.decode(f.read(HEADER_BYTES), path)
        except Exception as exc:  # noqa: BLE001 - every header failure is a finding
            out.append(Problem("disk_header", path, str(exc)))
            continue
        num_slots = header.num_slots
        size = os.path.getsize(path)
        if size < header.file_bytes:
            first = max(size - header.data_offset, 0) // header.block_bytes
            out.append(Problem("disk_size", path, f"{size} bytes, its header says "
                               f"{header.file_bytes}: truncated; slots from {first} on are lost"))
    return out, num_slots


def check_pool(pool: str, scratch: str, config: EngineConfig, progress=None) -> PoolReport:
    """Check one pool (see the module docstring) on a copy made under ``scratch``."""
    from prefixd.engine.durable import DurableCache

    problems, num_slots = _disk_size_problems(pool)
    if not os.path.exists(os.path.join(pool, "wal", "data.mdb")):
        problems.append(Problem("wal", os.path.join(pool, "wal"), "no data.mdb: the index of "
                                "this pool is gone"))
        return PoolReport(pool, 0, 0, [], problems)
    copy = os.path.join(scratch, "pool")
    shutil.copytree(os.path.join(pool, "wal"), os.path.join(copy, "wal"),
                    ignore=shutil.ignore_patterns("lock.mdb"))
    for path in glob.glob(os.path.join(pool, "*.disk.pool")):
        shutil.copyfile(path, os.path.join(copy, os.path.basename(path)))
    layout, tenant_name = _layout_and_tenant(pool, copy, problems)
    if layout is None:
        problems.append(Problem("layout", pool, "no readable manifest, disk header or log meta "
                                "names this pool's KV layout"))
        return PoolReport(pool, 0, 0, [], problems)
    _check_lmdb(copy, pool, problems)
    records = _check_log(copy, pool, problems)
    tenant = config.tenant(tenant_name) if tenant_name else None
    kwargs = cache_kwargs(config, tenant or config.tenants[0])
    kwargs.update(verify="lazy", sync="none", shm_dir=os.path.join(scratch, "shm"),
                  reclaim_grace_s=3600.0, forget_missing_tier=False)
    os.makedirs(kwargs["shm_dir"])
    sizes = list((config.blocks_for(layout) or TierSizes()).as_tuple())  # disk: the file's own
    if num_slots is not None:
        sizes[DISK] = num_slots
    try:
        dc = DurableCache(copy, layout, tuple(sizes), **kwargs)
    except Exception as exc:  # noqa: BLE001 - every refusal of recovery is a finding
        problems.append(Problem("index", pool, f"recovery refuses this pool: "
                                f"{type(exc).__name__}: {_local(str(exc), copy, pool)}"))
        return PoolReport(pool, records, 0, [], problems)
    try:
        checked, bad = _check_blocks(dc, progress)
        disk_path = _local(dc.store.pool(DISK).path, copy, pool) if bad else ""
        for slot in bad:
            problems.append(Problem("disk_block", disk_path, f"slot {slot}: bytes do not match "
                                    f"their checksum in the index"))
        try:
            dc.check_invariants()
        except AssertionError as exc:
            problems.append(Problem("index", pool, f"the rebuilt index is inconsistent: {exc}"))
    finally:
        dc.close()
    return PoolReport(pool, records, checked, bad, problems)


def _check_lmdb(copy: str, pool: str, problems: list[Problem]) -> None:
    """LMDB's structure, walked offline (``lmdb.verify``); each finding is a problem. A leak
    (pages neither reachable nor free) is one too: the open lets it through (it misdirects no
    read), but a healthy LMDB file has none."""
    from lmdb import verify as lmdb_verify

    path = os.path.join(pool, "wal", "data.mdb")
    try:
        found = lmdb_verify.verify(os.path.join(copy, "wal", "data.mdb"), subdir=False)
    except Exception as exc:  # noqa: BLE001 - a walk that cannot finish is a finding
        found = [f"the check could not finish: {type(exc).__name__}: {exc}"]
    problems.extend(Problem("wal", path, f"LMDB structure: {_local(f, copy, pool)}") for f in found)


def _check_log(copy: str, pool: str, problems: list[Problem]) -> int:
    """Read the checkpoint and every record after it; returns the records read."""
    from prefixd.wal.wal import Wal

    records = 0
    try:
        with Wal(copy, layouts=None, sync="none") as wal:
            lsn, _, _ = wal.load_checkpoint()
            for _, batch in wal.replay_batches(lsn):
                records += len(batch)
    except Exception as exc:  # noqa: BLE001 - every failure to read the log is a finding
        problems.append(Problem("wal", os.path.join(pool, "wal", "data.mdb"),
                                f"{type(exc).__name__}: {_local(str(exc), copy, pool)}"))
    return records


def _check_blocks(dc, progress) -> tuple[int, list[int]]:
    """Every disk block the index names, against its checksum; ``(checked, bad slots)``."""
    nodes = [n for n in dc.cache.tree.nodes() if n.slots[DISK] is not None]
    total = sum(len(n.slots[DISK]) for n in nodes)
    checked, bad = 0, []
    for node in nodes:
        slots = list(node.slots[DISK])
        if node.checksums is None or len(node.checksums) != len(slots):
            bad += slots
        else:
            ok = dc.store.verify(DISK, slots, node.checksums)
            bad += [s for s, good in zip(slots, ok) if not good]
        checked += len(slots)
        if progress is not None:
            progress(checked, total)
    return checked, sorted(bad)


def _local(message: str, copy: str, pool: str) -> str:
    """A message about the scratch copy, naming the original files instead."""
    return message.replace(copy, pool)


# -- running it: a child per pool, the report, the progress bar ---------------------------------

def _run_one(pool: str, config: EngineConfig, scratch_root: str | None,
             bar: "Bar | None") -> PoolReport:
    """``check_pool`` on a scratch directory that is removed afterwards."""
    scratch = tempfile.mkdtemp(prefix="prefixd-verify-", dir=scratch_root)
    try:
        return check_pool(pool, scratch, config, bar.update if bar else None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Bar:
    """A progress bar on stderr, only when stderr is a terminal (a log file gets nothing)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._last = 0.0

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // total if total else width
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{done}/{total} blocks")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def verify(state_dir: str, config: EngineConfig, scratch: str | None = None,
           show_progress: bool = False) -> list[PoolReport]:
    """Every pool's report. Raises StateLockedError: a daemon (or engine) holds the directory."""
    lock = StateDirLock(state_dir)
    try:
        pools = pool_dirs(state_dir)
        reports = []
        for i, pool in enumerate(pools):
            bar = Bar(f"pool {i + 1}/{len(pools)}") if show_progress else None
            reports.append(_run_one(pool, config, scratch, bar))
        return reports
    finally:
        lock.release()


def _load_config(path: str | None) -> EngineConfig:
    if path is None:
        return EngineConfig()
    with open(path, "rb") as f:
        return engine_config(tomllib.load(f).get("engine", {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixctl verify", description="Check a stopped "
                                     "daemon's state directory: log, checkpoint, disk blocks, "
                                     "index against pool files. Reports, never repairs.")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--config", help="the daemon's config file (pool sizes, tenants' salts)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--scratch", help="where the working copies go (default: $TMPDIR)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    state_dir = os.path.abspath(args.state_dir)
    if not os.path.isdir(state_dir):
        print(f"prefixctl verify: {state_dir} is not a directory", file=sys.stderr)
        return EXIT_UNCHECKED
    try:
        config = _load_config(args.config)
        reports = verify(state_dir, config, args.scratch,
                         show_progress=not args.json and sys.stderr.isatty())
    except StateLockedError as exc:
        print(f"prefixctl verify: {exc}: stop the daemon first (systemctl stop prefixd)",
              file=sys.stderr)
        return EXIT_UNCHECKED
    except Exception as exc:  # noqa: BLE001 - a config or directory that cannot be read
        print(f"prefixctl verify: cannot check {state_dir}: {exc}", file=sys.stderr)
        return EXIT_UNCHECKED
    damaged = any(r.problems for r in reports)
    if args.json:
        print(json.dumps({"state_dir": state_dir, "ok": not damaged, "pools": [
            r._asdict() | {"problems": [p._asdict() for p in r.problems]} for r in reports]},
            indent=1))
    else:
        for r in reports:
            print(f"{'DAMAGED' if r.problems else 'ok'} {r.path}: {r.records} log records, "
                  f"{r.checked_blocks} disk blocks checked")
            for p in r.problems:
                print(f"  {p.what}: {p.path}: {p.message}")
        if not reports:
            print(f"no pools under {state_dir}")
    return EXIT_DAMAGED if damaged else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
