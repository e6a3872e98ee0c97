"""The child of the sparse-pool-file crash suite (``tests/crash/test_extents_kill9.py``).

``python -m tests.crash.extents_workload DIR [--rounds N] [--seed S]`` grows, writes, frees and
shrinks one sparse pool file in DIR under the engine's write order, and keeps a log of what it
made durable in ``DIR/acks`` (one fsynced line per record, as the WAL would):

* ``put SLOT CHECKSUM``: after ``take`` (the extents grown) and the block's bytes written and
  fdatasynced: data before metadata;
* ``free SLOT``: before ``give_back`` and ``shrink``: free before reuse.

``check(DIR)`` is what recovery does: reopen the file, ``recover`` the slots the log names, and
compare every live block's bytes with its checksum.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np

from prefixd.storage import checksum
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.extents import SparsePoolFile
from prefixd.storage.poolfile import DATA_OFFSET, PoolHeader

BLOCK = 16 * 1024
SLOTS = 256
EXTENT = 64 * 1024
BUDGET = 8 << 20
FILE_ID = b"extents-crash-01"


def header() -> PoolHeader:
    return PoolHeader(2, BLOCK, SLOTS, FILE_ID, b"extents-crash-workload")


def open_pool(directory: str, ledger: BudgetLedger | None = None) -> SparsePoolFile:
    return SparsePoolFile(os.path.join(directory, "p.pool"), header(), tenant="t", durable=True,
                          ledger=ledger or BudgetLedger("disk", BUDGET), expect_file_id=True,
                          extent_bytes=EXTENT)


def read_log(directory: str) -> dict[int, int]:
    """The live blocks the log names: slot -> checksum (a torn last line is ignored)."""
    live: dict[int, int] = {}
    try:
        with open(os.path.join(directory, "acks")) as f:
            lines = f.read().split("\n")[:-1]
    except FileNotFoundError:
        return live
    for line in lines:
        kind, *rest = line.split()
        if kind == "put":
            live[int(rest[0])] = int(rest[1])
        else:
            live.pop(int(rest[0]), None)
    return live


def puts_logged(directory: str) -> int:
    """How many blocks the log has ever named (its ``put`` lines, frees not subtracted): what a
    test waits on to know the workload got on, whatever share of the slots is live."""
    try:
        with open(os.path.join(directory, "acks")) as f:
            return f.read().count("put ")
    except FileNotFoundError:
        return 0


def run(directory: str, rounds: int, seed: int, data_sync: bool = True) -> None:
    rng = random.Random(seed)
    pool = open_pool(directory)
    live = read_log(directory)
    pool.recover(sorted(live))
    free = sorted(set(range(SLOTS)) - set(live), reverse=True)
    log_fd = os.open(os.path.join(directory, "acks"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for _ in range(rounds):
        batch = [free.pop() for _ in range(min(len(free), rng.randrange(1, 12)))]
        if batch:
            assert pool.take(batch)
            lines = []
            for s in batch:
                data = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, BLOCK, dtype=np.uint8)
                os.pwrite(pool.fd, data.tobytes(), DATA_OFFSET + s * BLOCK)
                lines.append(f"put {s} {checksum.checksum(data)}\n")
                live[s] = 0
            if data_sync:  # off only for the control that shows the harness sees loss
                os.fdatasync(pool.fd)
            os.write(log_fd, "".join(lines).encode())
            os.fsync(log_fd)
        if live and rng.random() < 0.6:
            gone = rng.sample(sorted(live), min(len(live), rng.randrange(1, 16)))
            os.write(log_fd, "".join(f"free {s}\n" for s in gone).encode())
            os.fsync(log_fd)
            pool.give_back(gone)
            pool.shrink()
            for s in gone:
                del live[s]
            free.extend(gone)
        pool.check_invariants()
    os.close(log_fd)
    pool.close()


def check(directory: str) -> dict:
    """Recover the file as the engine would; returns counts (``lost``, ``wrong`` must be 0)."""
    live = read_log(directory)
    ledger = BudgetLedger("disk", BUDGET)
    pool = open_pool(directory, ledger)
    pool.recover(sorted(live))
    pool.check_invariants()
    ledger.check_invariants()
    wrong = 0
    for s, want in live.items():
        got = os.pread(pool.fd, BLOCK, DATA_OFFSET + s * BLOCK)
        wrong += checksum.checksum(got) != want
    held, charged = pool.held_bytes(), pool.charged
    pool.close()
    return {"live": len(live), "wrong": wrong, "held": held, "charged": charged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-data-sync", action="store_true",
                        help="log blocks without syncing their bytes first (a control: it loses)")
    args = parser.parse_args()
    run(args.directory, args.rounds, args.seed, data_sync=not args.no_data_sync)


if __name__ == "__main__":
    main()
