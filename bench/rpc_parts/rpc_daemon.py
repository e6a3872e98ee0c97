"""The daemon ``bench/rpc.py`` measures: its own ``prefixd serve`` process (started by
``prefixd.tools.daemon_proc``, as the tests' and the demo's are), optionally under cProfile,
and what its log holds.

The state directory and socket sit in a short ``/tmp`` directory (a Unix socket path holds 107
bytes) on the same file system as the floor's LMDB environment; the pools live in a fresh
directory of ``/dev/shm`` (shared memory, as in production), removed at the end.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile

import lmdb

from affinity import preexec
from prefixd.tools.daemon_proc import DaemonFailed, DaemonProc
from prefixd.wal.codec import decode, unpack_key
from prefixd.wal.env import MAX_DBS
from prefixd.wal.kinds import Kind

# the KV / Attend layout's own pool, after the tool's ``CONFIG``'s ``[engine.blocks]``
TINY_POOL = """
[engine.blocks.models."{tiny}"]
device = {tiny_device}
host = 256
disk = 0
"""


_PROFILED = """
import atexit, cProfile, runpy, sys
profile = cProfile.Profile()
atexit.register(profile.dump_stats, {profile!r})
sys.argv = sys.argv[1:]
profile.enable()
if sys.argv[0] == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


class BenchDaemon(DaemonProc):
    """One daemon process over ``base/state`` on ``base/run/s.sock`` (``DaemonProc``, the one
    helper that starts a daemon), its pools in ``/dev/shm``; a context manager that starts it
    and, on leaving, stops it (SIGTERM: a profile is written) and removes both directories.

    Args:
        blocks: ``(device, host, disk)`` blocks of the gsp layout's pool.
        tiny: ``(model_id, device blocks)`` of the KV / Attend layout's pool.
        profile: a path: run the daemon under cProfile, its stats written there at the clean
            stop (by an exit handler: ``_PROFILED``).
        entry: what follows the interpreter instead of ``-m prefixd.daemon.cli`` (a script
            that wraps the daemon).
        sync: ``[engine] sync`` (``"commit"``: what ``bench/rpc.py`` measures; ``"none"``: a
            daemon whose commits never wait for an fsync).
        cpus: the CPUs the daemon process runs on (``affinity.py``); None: all.
        env: more environment variables for the daemon process.
    """

    def __init__(self, blocks: tuple[int, int, int], tiny: tuple[str, int],
                 profile: str | None = None, entry: list[str] | None = None, sync: str = "commit",
                 cpus: frozenset[int] | None = None, env: dict[str, str] | None = None) -> None:
        device, host, disk = blocks
        self.shm = tempfile.mkdtemp(prefix="prefixd-bench-", dir="/dev/shm")
        # the daemon ends its process itself (server.py's NOTE at _shutdown): the profile is
        # written by an exit handler, which it runs
        prof = ["-c", _PROFILED.format(profile=profile)] if profile else []
        super().__init__(tempfile.mkdtemp(prefix="pdb-", dir="/tmp"), lease_s=30.0,
                         device=device, host=host, disk=disk, shm_dir=self.shm, env=env,
                         entry=prof + (entry or ["-m", "prefixd.daemon.cli"]),
                         fields=dict(sync=sync, engine_tables=TINY_POOL.format(tiny=tiny[0], tiny_device=tiny[1])),
                         preexec_fn=preexec(cpus))

    def __enter__(self) -> "BenchDaemon":
        try:
            self.start(120.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (a clean stop writes the profile); returns the exit status."""
        try:
            return super().stop(timeout)
        except DaemonFailed:
            return self.proc.returncode

    def log(self) -> str:
        return self.log_tail(8000)

    def __exit__(self, *exc) -> None:
        self.stop()
        super().close()
        shutil.rmtree(self.shm, ignore_errors=True)

    # -- the log ---------------------------------------------------------------------------------

    def wal_dir(self, model_id: str) -> str:
        found = glob.glob(os.path.join(self.state_dir, "pools", "*", model_id + "-*", "wal"))
        if len(found) != 1:
            raise RuntimeError(f"expected one WAL of pool {model_id!r}, found {found}")
        return found[0]

    def last_lsn(self, model_id: str) -> int:
        return max((lsn for lsn, _, _ in self._records(model_id, 0)), default=0)

    def request_record_bytes(self, model_id: str, after_lsn: int) -> dict:
        """Bytes (keys + values) the engine logged per request after ``after_lsn``, for one
        client's serial requests: each request's records start with its OPEN record."""
        per_request: list[int] = []
        records = 0
        for _, kind, size in self._records(model_id, after_lsn):
            if kind == Kind.OPEN or not per_request:
                per_request.append(0)
            per_request[-1] += size
            records += 1
        if not per_request:
            raise RuntimeError("the daemon logged nothing for the measured requests")
        return {"requests": len(per_request), "records": records,
                "median_bytes": int(statistics.median(per_request)),
                "mean_bytes": round(sum(per_request) / len(per_request), 1)}

    def wal_txn_id(self, model_id: str) -> int:
        """LMDB's last committed write transaction of the pool's WAL: one per group commit
        (and one per fsync, with ``sync = "commit"``), plus the rare checkpoint's; 0 before
        the pool exists (its first Attach makes it)."""
        if not glob.glob(os.path.join(self.state_dir, "pools", "*", model_id + "-*", "wal")):
            return 0
        env = lmdb.open(self.wal_dir(model_id), readonly=True, lock=True, max_dbs=MAX_DBS,
                        subdir=True)
        try:
            return env.info()["last_txnid"]
        finally:
            env.close()

    def _records(self, model_id: str, after_lsn: int):
        """``(lsn, kind, key + value bytes)`` of the pool's log records past ``after_lsn``,
        read through LMDB's multi-process readers while the daemon writes."""
        env = lmdb.open(self.wal_dir(model_id), readonly=True, lock=True, max_dbs=MAX_DBS,
                        subdir=True)
        try:
            db = env.open_db(b"log", create=False)
            with env.begin(db=db, buffers=False) as txn:
                for key, value in txn.cursor():
                    lsn = unpack_key(key)
                    if lsn > after_lsn:
                        yield lsn, decode(lsn, value).kind, len(key) + len(value)
        finally:
            env.close()
