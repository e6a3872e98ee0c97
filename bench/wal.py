"""WAL throughput against a plain-LMDB floor, in the same run.

For each group size G (records per durable commit), two loops write the same record bytes:

- floor: a bare LMDB loop (same environment flags as the Wal: sync on, max_dbs) that commits G
  pre-encoded records per write txn with ``putmulti(append=True)``;
- wal: ``Wal(sync="commit")``: G x ``append`` (encoding included) then ``flush().result()``.

Runs alternate floor / wal several times and report medians, because the host is shared and
noisy. ``ratio`` = wal / floor at G = 64. Also: codec encode/decode cost, concurrent appenders
(groups formed by the committer), and the rejected ``sync=False`` + ``env.sync(True)`` floor.

Usage: ``python bench/wal.py --json [--reps 5] [--dir DIR]``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lmdb  # noqa: E402

from prefixd.wal import Kind, Wal, decode, encode  # noqa: E402
from prefixd.wal.env import DB_NAMES, MAX_DBS  # noqa: E402

BLOCKS_PER_PUT = 24
BLOCK_META = 16 + 64 + 12  # hash + 16 tokens x u32 + slot/checksum


def make_records(n: int, seed: int = 0) -> list[tuple[int, tuple, bytes]]:
    """A realistic mix, cycling OPEN, BLOCK_PUT, COMMIT, RELEASE: (kind, fields, blob)."""
    rng = random.Random(seed)
    put_blob = rng.randbytes(BLOCKS_PER_PUT * BLOCK_META)  # 2,208 B
    open_blob = rng.randbytes(BLOCKS_PER_PUT * 16)  # matched block hashes
    commit_blob = rng.randbytes(8 * (16 + 4))  # newly full blocks: hash + slot
    out = []
    for i in range(n):
        seq = i // 4 + 1
        match i % 4:
            case 0:
                out.append((Kind.OPEN, (seq, 7, 2048 + 128, BLOCKS_PER_PUT), open_blob))
            case 1:
                out.append((Kind.BLOCK_PUT, (1, BLOCKS_PER_PUT), put_blob))
            case 2:
                out.append((Kind.COMMIT, (seq, 8), commit_blob))
            case _:
                out.append((Kind.RELEASE, (seq,), b""))
    return out


def bench_helpers_env(path: str, sync: bool = True) -> lmdb.Environment:
    """An environment with the Wal's flags (for floors and for other benches)."""
    return lmdb.open(path, map_size=1 << 30, max_dbs=MAX_DBS, sync=sync, metasync=True, lock=True)


def floor_run(path: str, values: list[bytes], group: int, explicit_sync: bool = False) -> float:
    """Plain LMDB: ``group`` pre-encoded records per durable commit. Returns records/s."""
    env = bench_helpers_env(path, sync=not explicit_sync)
    db = env.open_db(DB_NAMES[0])
    key = struct.Struct(">Q").pack
    n = len(values) - len(values) % group
    t0 = time.perf_counter()
    for start in range(0, n, group):
        items = [(key(start + i + 1), values[start + i]) for i in range(group)]
        with env.begin(write=True, db=db) as txn:
            txn.cursor().putmulti(items, append=True)
        if explicit_sync:
            env.sync(True)
    elapsed = time.perf_counter() - t0
    env.close()
    return n / elapsed


def wal_run(path: str, records: list, group: int, window: int = 0) -> tuple[float, list[float], float]:
    """Wal(sync=commit, max_group_records=group): append ``group`` records, then ``flush()``.

    ``window`` = 0: wait for each ticket before appending more (no overlap at all).
    ``window`` = W: keep up to W tickets outstanding, as a daemon serving several requests does;
    the next group is encoded while the previous one fsyncs (the GIL is released during fsync).
    The cap keeps every durable commit at exactly ``group`` records, like the floor.

    Returns:
        (records/s, ticket latencies in seconds, mean records per durable commit).
    """
    wal = Wal(path, layouts=b"bench", sync="commit", max_group_records=group)
    append, flush = wal.append, wal.flush
    n = len(records) - len(records) % group
    latencies: list[float] = []
    outstanding: deque = deque()
    t0 = time.perf_counter()
    for start in range(0, n, group):
        for kind, fields, blob in records[start : start + group]:
            append(kind, *fields, blob=blob)
        outstanding.append((time.perf_counter(), flush()))
        while len(outstanding) > window:
            t1, ticket = outstanding.popleft()
            ticket.result()
            latencies.append(time.perf_counter() - t1)
    for t1, ticket in outstanding:
        ticket.result()
        latencies.append(time.perf_counter() - t1)
    elapsed = time.perf_counter() - t0
    stats = wal.stats()
    assert stats.records_committed == n, stats
    wal.close()
    return n / elapsed, latencies, stats.records_committed / stats.groups_committed


def concurrent_run(path: str, records: list, threads: int, per_flush: int) -> dict:
    """``threads`` appenders, each flushing every ``per_flush`` records: the committer groups them."""
    wal = Wal(path, layouts=b"bench", sync="commit")
    chunk = len(records) // threads

    def worker(part: list) -> None:
        for start in range(0, len(part), per_flush):
            for kind, fields, blob in part[start : start + per_flush]:
                wal.append(kind, *fields, blob=blob)
            wal.flush().result()

    pool = [threading.Thread(target=worker, args=(records[i * chunk : (i + 1) * chunk],)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    stats = wal.stats()
    wal.close()
    return {"threads": threads, "records_per_flush": per_flush,
            "records_per_s": round(stats.records_committed / elapsed),
            "mean_group_size": round(stats.records_committed / stats.groups_committed, 1),
            "groups": stats.groups_committed}


def codec_cost(records: list, n: int = 100_000) -> dict:
    sample = (records * (n // len(records) + 1))[:n]
    t0 = time.perf_counter()
    values = [encode(k, f, b) for k, f, b in sample]
    t1 = time.perf_counter()
    for lsn, v in enumerate(values, 1):
        decode(lsn, v)
    t2 = time.perf_counter()
    return {"encode_ns_per_record": round((t1 - t0) / n * 1e9), "decode_ns_per_record": round((t2 - t1) / n * 1e9),
            "mean_record_bytes": round(sum(map(len, values)) / n, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    ap.add_argument("--reps", type=int, default=5, help="alternating floor/wal repetitions per group size")
    ap.add_argument("--records", type=int, default=19_200, help="records per run at group 64")
    ap.add_argument("--window", type=int, default=2, help="flush tickets outstanding in the wal loop")
    ap.add_argument("--dir", default=None, help="directory for the temporary environments")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="prefixd-bench-wal-", dir=args.dir)
    records = make_records(args.records)
    values = [encode(k, f, b) for k, f, b in records]
    sizes = {1: args.records // 32, 8: args.records // 4, 64: args.records, 256: args.records * 2}
    by_group: dict[str, dict] = {}
    latencies_64: list[float] = []
    run = 0
    try:
        for group, n in sizes.items():
            recs = (records * (n // len(records) + 1))[:n]
            vals = (values * (n // len(values) + 1))[:n]
            floors, wals, serials, group_sizes = [], [], [], []
            for _ in range(args.reps):
                run += 1
                floors.append(floor_run(os.path.join(root, f"floor{run}"), vals, group))
                rate, lat, mean_group = wal_run(os.path.join(root, f"wal{run}"), recs, group, args.window)
                wals.append(rate)
                group_sizes.append(mean_group)
                serials.append(wal_run(os.path.join(root, f"serial{run}"), recs, group, 0)[0])
                if group == 64:
                    latencies_64 += lat
                for name in ("floor", "wal", "serial"):
                    shutil.rmtree(os.path.join(root, f"{name}{run}"))
            floor, wal, serial = (statistics.median(x) for x in (floors, wals, serials))
            by_group[str(group)] = {"floor_records_per_s": round(floor), "wal_records_per_s": round(wal),
                                    "ratio": round(wal / floor, 3), "serial_records_per_s": round(serial),
                                    "serial_ratio": round(serial / floor, 3),
                                    "records_per_durable_commit": round(statistics.mean(group_sizes), 2),
                                    "records": n}
        nosync = [floor_run(os.path.join(root, f"nosync{i}"), values, 64, explicit_sync=True) for i in range(args.reps)]
        concurrent = concurrent_run(os.path.join(root, "concurrent"), records, threads=8, per_flush=8)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    latencies_64.sort()
    at64 = by_group["64"]
    result = {
        "bench": "wal",
        "params": {"sync": "commit", "group_size": 64, "reps": args.reps, "records_at_64": args.records,
                   "window": args.window,
                   "mix": "OPEN(384 B blob), BLOCK_PUT(24 x 92 B), COMMIT(160 B), RELEASE",
                   "wal": "append+encode each record, flush per group, up to `window` tickets outstanding",
                   "serial": "same, but each ticket awaited before the next append (no overlap)",
                   "floor": "pre-encoded bytes, one putmulti(append=True) txn per group, sync=True env",
                   "lmdb": ".".join(map(str, lmdb.version())), "py_lmdb": lmdb.__version__},
        "wal.records_per_s": at64["wal_records_per_s"],
        "wal.floor_records_per_s": at64["floor_records_per_s"],
        "ratio": at64["ratio"],
        "wal.serial_records_per_s": at64["serial_records_per_s"],
        "serial_ratio": at64["serial_ratio"],
        "by_group_size": by_group,
        "ticket_latency_us_at_64": {"p50": round(latencies_64[len(latencies_64) // 2] * 1e6),
                                    "p99": round(latencies_64[int(len(latencies_64) * 0.99)] * 1e6)},
        "floor_sync_false_explicit_fsync_records_per_s_at_64": round(statistics.median(nosync)),
        "concurrent": concurrent,
        "codec": codec_cost(records),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
