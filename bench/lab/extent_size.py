"""What an extent of a sparse pool file costs to grow (fallocate, + fsync on disk) and to give
back (punch), by extent size, on shm and on the state directory's filesystem. Prints JSON.

    python bench/lab/extent_size.py [--shm /dev/shm] [--disk DIR] [--total-mib 256]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from prefixd.storage import falloc

SIZES_KIB = (64, 256, 1024, 2048, 8192, 32768)


def measure(directory: str, extent: int, total: int, fsync: bool) -> dict:
    fd, path = tempfile.mkstemp(dir=directory, prefix="extent-bench-")
    try:
        os.ftruncate(fd, total)
        n = total // extent
        t0 = time.perf_counter()
        for k in range(n):
            falloc.allocate(fd, path, k * extent, extent)
            if fsync:
                os.fsync(fd)
        t1 = time.perf_counter()
        for k in range(n):
            falloc.punch(fd, path, k * extent, extent)
        t2 = time.perf_counter()
        return {"extent_kib": extent >> 10, "grow_us": round((t1 - t0) / n * 1e6, 1),
                "grow_us_per_mib": round((t1 - t0) / n * 1e6 / (extent / (1 << 20)), 1),
                "punch_us": round((t2 - t1) / n * 1e6, 1)}
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shm", default="/dev/shm")
    parser.add_argument("--disk", default=tempfile.gettempdir())
    parser.add_argument("--total-mib", type=int, default=256)
    args = parser.parse_args()
    total = args.total_mib << 20
    out = {"total_mib": args.total_mib, "shm": [], "disk": [], "disk_dir": args.disk}
    for kib in SIZES_KIB:
        out["shm"].append(measure(args.shm, kib << 10, total, fsync=False))
        out["disk"].append(measure(args.disk, kib << 10, total, fsync=True))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
