"""Workload children for the PowerFS self-tests, and the checker that reads their result back.

``python -m tests.crash.workloads lmdb ENV ACKS --seed S [--nosync]`` commits transactions into an
LMDB environment until killed and acks each after `commit()` returned. Transaction ``i`` puts a new
key ``n<i>`` and overwrites ``k<i % 64>`` (so LMDB reuses freed pages and the cut can tear
pages that a durable tree still points to if the sync order were wrong). Values are
self-describing: ``b"<i>:"`` plus bytes drawn from ``Random(seed * 1_000_003 + i)``, 100 to 6000
long (some need overflow pages).

With ``--nosync`` the environment is opened ``sync=False, metasync=False``: transaction 0 is made
durable with ``env.sync(True)`` so the file and a base state exist on disk, and nothing after it is
ever synced. That is the control run: a power cut must lose acknowledged transactions.

``python -m tests.crash.workloads check-lmdb ENV ACKS --seed S`` opens the environment in its own
process (a torn LMDB file may crash the reader, which must not take the test process with it)
and prints one JSON line: ``{"problems": [...], "num_keys": N}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lmdb

from tests.crash.acklog import AckLog, read_acks

NUM_HOT_KEYS = 64
MAP_SIZE = 256 << 20


def value_for(seed: int, i: int) -> bytes:
    rng = random.Random(seed * 1_000_003 + i)
    return f"{i}:".encode() + rng.randbytes(rng.randint(100, 6000))


def run_lmdb(env_dir: str, ack_path: str, seed: int, nosync: bool) -> None:
    env = lmdb.open(env_dir, map_size=MAP_SIZE, sync=not nosync, metasync=not nosync)
    acks = AckLog(ack_path)
    i = 0
    while True:
        with env.begin(write=True) as txn:
            txn.put(f"n{i}".encode(), value_for(seed, i))
            txn.put(f"k{i % NUM_HOT_KEYS}".encode(), value_for(seed, i))
        if nosync and i == 0:
            env.sync(True)
        acks.ack(str(i))
        i += 1


def check_lmdb(env_dir: str, acked: list[int], seed: int) -> dict:
    """Every acked transaction's effects, read back: missing or wrong values are problems."""
    problems: list[str] = []
    try:
        env = lmdb.open(env_dir, map_size=MAP_SIZE, create=False)
    except lmdb.Error as exc:
        return {"problems": [f"open failed: {type(exc).__name__}: {exc}"], "num_keys": 0}
    try:
        with env.begin() as txn:
            data = dict(txn.cursor())
    except lmdb.Error as exc:
        return {"problems": [f"read failed: {type(exc).__name__}: {exc}"], "num_keys": 0}
    finally:
        env.close()
    last_acked: dict[int, int] = {}
    for i in acked:
        last_acked[i % NUM_HOT_KEYS] = i
        got = data.get(f"n{i}".encode())
        if got is None:
            problems.append(f"n{i}: missing")
        elif got != value_for(seed, i):
            problems.append(f"n{i}: wrong value")
    for hot, i in last_acked.items():
        got = data.get(f"k{hot}".encode())
        version = int(got.split(b":", 1)[0]) if got else -1
        if version < i or version % NUM_HOT_KEYS != hot or got != value_for(seed, version):
            problems.append(f"k{hot}: holds version {version}, acked {i}")
    return {"problems": problems, "num_keys": len(data)}


def check_lmdb_in_child(env_dir: str | os.PathLike, ack_path: str | os.PathLike, seed: int) -> list[str]:
    """`check_lmdb` in a child process; a crash or hang of the reader is a problem too."""
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "tests.crash.workloads", "check-lmdb", str(env_dir),
           str(ack_path), "--seed", str(seed)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=repo, env=env)
    except subprocess.TimeoutExpired:
        return ["checker hung reading the environment"]
    if out.returncode != 0:
        return [f"checker died rc={out.returncode}: {out.stderr[-300:]!r}"]
    return json.loads(out.stdout)["problems"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tests.crash.workloads")
    parser.add_argument("what", choices=["lmdb", "check-lmdb"])
    parser.add_argument("env_dir")
    parser.add_argument("ack_path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nosync", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "lmdb":
        run_lmdb(args.env_dir, args.ack_path, args.seed, args.nosync)
        return 0
    acked = [int(a) for a in read_acks(args.ack_path)]
    print(json.dumps(check_lmdb(args.env_dir, acked, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
