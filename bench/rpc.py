"""The daemon's cost over a bare gRPC + LMDB floor, in one run.

Starts its own ``prefixd serve`` (``[engine] sync = "commit"``, state in a short ``/tmp``
directory, pools in ``/dev/shm``) and a bare ``grpc.aio`` echo server (``rpc_parts/rpc_echo.py``), each in
its own process on a Unix socket, and prints one JSON object:

- ``rpc.p50_us`` / ``rpc.p99_us``: one client (``prefixd.client``), gsp requests: ``open`` of
  the prompt (2,048-token system prompt + 128-token question = 2,176 tokens) then ``release``
  with commit at durability ``crash`` (the reply waits for the WAL's fsync). Layout ``bench-rpc``:
  1 layer x 1 KV head x head dim 8, fp16, block 16 (512-byte blocks, as ``bench/engine.py``), so
  that the daemon's own work shows, not memcpy. Tiers device / host / disk, each larger than
  the workload (no eviction; the disk tier gets the write-through spills every tick, as in
  production; ``--disk-blocks 0`` drops it).
- ``floor.p50_us``: per request, two bare echoes of the byte sizes of Open's request / reply and
  Release's, plus one durable LMDB commit (the WAL's environment flags) of one put as large as
  the records the engine logged for the median request (read back from the daemon's own log).
  One-client rounds alternate daemon / floor so that the host's noise lands on both
  (``--rounds``, 32 by default: on the shared 2-core host the ratio of 4 rounds of 240
  requests swung 1.18-1.71 between runs of one tree, that of 32 rounds of 30 1.44-1.51).
- ``rpc.rps_8``: 8 client processes doing gsp requests together (requests per second, all of
  them); ``floor.rps_8``: 8 processes doing the echo pairs (no LMDB commit: the daemon must
  share its fsyncs among the 8 clients' commits to get near). ``--phases`` (3) alternations of
  the two, each on fresh prompts; a side's rate is its requests over its measured seconds, its
  ``client_cpu_us`` the client processes' CPU per request meanwhile.
- ``kv.*`` and ``attend.*``: see ``rpc_parts/rpc_kv.py`` (layout ``tiny-llama``: 4 layers x 2 KV heads x
  head dim 64, fp16, block 16).

Usage: ``python bench/rpc.py --json [--quick] [--rounds N] [--phases N] [--out PATH]
[--profile PATH]``. ``--profile`` runs the daemon under cProfile (written at its clean stop;
the top of it goes to stderr): use it with ``--sections rpc`` to see where a request's time
goes, not for a run of record.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import pstats
import statistics
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH / "rpc_parts"))  # its parts: the daemon, the echo floor, the loops

from affinity import parse_cpus  # noqa: E402 - rpc_parts/ on the path first

SECTIONS = ("rpc", "rps8", "kv", "attend")
GSP_LAYOUT = dict(model_id="bench-rpc", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  block_size=16)
TINY_LAYOUT = dict(model_id="tiny-llama", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                   block_size=16)
WORKERS = 8
TARGETS = {"rpc_p50_over_floor": "<= 1.3", "rps_8_over_floor": ">= 0.6",
           "kv_mapped_over_memcpy": ">= 0.7", "kv_rpc_over_grpc_bytes": ">= 0.7",
           "attend_over_floor": "<= 1.3"}


def _us(ns: list[int], q: float = 0.5) -> float:
    ordered = sorted(ns)
    if q == 0.5:
        return round(statistics.median(ordered) / 1000, 1)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000, 1)


def _sizes() -> dict[str, tuple[int, int]]:
    """Request and reply bytes of a gsp request's Open and Release (block table of 136 slots)."""
    from prefixd.api import prefixd_pb2 as pb

    tokens, blocks = 2176, 2176 // GSP_LAYOUT["block_size"]
    sid, seq_id = (1 << 63) - 1, 1 << 40
    open_req = pb.OpenRequest(session_id=sid, tokens=bytes(4 * tokens))
    open_reply = pb.OpenReply(sequence=pb.SequenceReply(
        seq_id=seq_id, num_tokens=tokens, cached_tokens=2048, block_table=bytes(4 * blocks),
        num_indexed=128))
    release_req = pb.ReleaseRequest(session_id=sid, seq_id=seq_id, commit=True, durability="crash")
    return {"open": (open_req.ByteSize(), open_reply.ByteSize()),
            "release": (release_req.ByteSize(), pb.ReleaseReply().ByteSize())}


def one_client(daemon, echo, prompts: list[bytes], warmup: int, rounds: int, lmdb_dir: str) -> dict:
    """``rpc.p50_us`` / ``p99_us`` and ``floor.p50_us``, alternating rounds."""
    import prefixd.client as pc
    from rpc_load import LmdbCommit, floor_requests, gsp_requests

    sizes = _sizes()
    open_req, release_req = echo.request(*sizes["open"]), echo.request(*sizes["release"])
    model = GSP_LAYOUT["model_id"]
    rpc_ns, open_ns, floor_ns, echo_ns = [], [], [], []
    lmdb_commit = records = None
    measured = prompts[warmup:]
    per_round = -(-len(measured) // rounds)
    txns = 0
    with pc.connect(daemon.socket, pc.KVLayout(**GSP_LAYOUT), name="bench-rpc") as session:
        gsp_requests(session, prompts[:warmup])
        lsn = daemon.last_lsn(model)
        for r in range(rounds):
            part = measured[r * per_round:(r + 1) * per_round]
            txn0 = daemon.wal_txn_id(model)
            rpc_ns += gsp_requests(session, part, open_ns)
            txns += daemon.wal_txn_id(model) - txn0
            if lmdb_commit is None:  # the engine's records of the first round's requests
                records = daemon.request_record_bytes(model, lsn)
                lmdb_commit = LmdbCommit(lmdb_dir, max(1, records["median_bytes"] - 8))
                floor_requests(echo, open_req, release_req, lmdb_commit, min(warmup, 32))
            floor_ns += floor_requests(echo, open_req, release_req, lmdb_commit, len(part), echo_ns)
        client = "prefixd.client (connect; Session.open, Session.release)"
        mapped = session.mapped
    lmdb_commit.close()
    return {
        "client": client, "mapped": mapped, "requests": len(rpc_ns), "warmup": warmup, "rounds": rounds,
        "message_bytes": {k: {"request": a, "reply": b} for k, (a, b) in sizes.items()},
        "record_bytes": records, "wal_txns_per_request": round(txns / len(rpc_ns), 3),
        "rpc": {"p50_us": _us(rpc_ns), "p99_us": _us(rpc_ns, 0.99), "open_p50_us": _us(open_ns),
                "release_p50_us": _us([a - b for a, b in zip(rpc_ns, open_ns)])},
        "floor": {"p50_us": _us(floor_ns), "p99_us": _us(floor_ns, 0.99),
                  "echo_pair_p50_us": _us(echo_ns),
                  "lmdb_commit_p50_us": _us([a - b for a, b in zip(floor_ns, echo_ns)])},
    }


def eight_clients(daemon, echo_path: str, prompts: list[bytes], per_worker: int, warmup: int,
                  echo_pairs: int, phases: int) -> dict:
    """``rpc.rps_8`` and ``floor.rps_8``: ``phases`` alternations of 8 floor processes and 8
    client processes (each phase a fresh set, released together, on prompts no phase used
    before), so that the host's drift lands on both sides; each side's rate is all its
    requests over all its measured seconds."""
    from rpc_load import combine_runs, echo_worker, gsp_worker, run_workers

    n = warmup + per_worker
    if len(prompts) < phases * WORKERS * n:
        raise ValueError(f"{phases} phases of {WORKERS} x {n} requests need {phases * WORKERS * n} prompts, "
                         f"got {len(prompts)}")
    sizes = _sizes()
    model = GSP_LAYOUT["model_id"]
    floors, rpcs, txns = [], [], 0
    for k in range(phases):
        part = prompts[k * WORKERS * n:(k + 1) * WORKERS * n]
        floors.append(run_workers(echo_worker, [(echo_path, (sizes["open"], sizes["release"]), echo_pairs, warmup)
                                                for _ in range(WORKERS)]))
        txn0 = daemon.wal_txn_id(model)
        rpcs.append(run_workers(gsp_worker, [(daemon.socket, GSP_LAYOUT, part[i::WORKERS], warmup)
                                             for i in range(WORKERS)]))
        txns += daemon.wal_txn_id(model) - txn0
    rpc, floor = combine_runs(rpcs), combine_runs(floors)
    # every request of the runs (warm-ups included) against the WAL's write transactions
    rpc["requests_per_wal_txn"] = round(phases * WORKERS * n / max(1, txns), 2)
    return {"workers": WORKERS, "phases": phases, "rpc": rpc, "floor": floor}


def tiny_sections(daemon, echo, sections, kv_reps: int, attend_reps: int) -> dict:
    import prefixd.client as pc
    from rpc_kv import attend_section, kv_section

    layout = pc.KVLayout(**TINY_LAYOUT)
    out = {}
    with pc.connect(daemon.socket, layout, name="bench-kv-mapped", mapped=True) as mapped, \
            pc.connect(daemon.socket, layout, name="bench-kv-rpc", mapped=False) as remote:
        if "kv" in sections:
            out["kv"] = kv_section(mapped, remote, echo, kv_reps)
        if "attend" in sections:
            out["attend"] = attend_section(remote, echo, attend_reps)
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run(args) -> dict:
    from prefixd.tools.workloads import gsp
    from rpc_daemon import BenchDaemon
    from rpc_echo import EchoClient, EchoServer

    quick = args.quick
    groups, per_group = (4, 16) if quick else (64, 32)
    prompts = [r.prompt for r in gsp(groups, per_group)]
    warmup = 8 if quick else 64
    phases = args.phases
    warmup8, per_worker = (2, 14) if quick else (16, -(-240 // phases))
    # the 8 clients' own requests (another seed): warmup8 + per_worker each, in every phase
    prompts8 = [r.prompt for r in gsp(groups, -(-phases * WORKERS * (warmup8 + per_worker) // groups), seed=1)]
    echo_pairs = 50 if quick else -(-1000 // phases)
    kv_reps, attend_reps = (3, 3) if quick else (20, 30)
    rounds = 2 if quick else args.rounds
    blocks = (131072, 131072, args.disk_blocks)  # both gsp workloads fit: no eviction
    sections = args.sections
    result: dict = {"bench": "rpc"}
    t_start = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdb-floor-", dir="/tmp") as tmp, \
            EchoServer(os.path.join(tmp, "echo.sock"), cpus=args.server_cpus) as echo_server, \
            BenchDaemon(blocks, (TINY_LAYOUT["model_id"], 4096), profile=args.profile,
                        cpus=args.server_cpus) as daemon:
        echo_path = echo_server.path
        echo = EchoClient(echo_path)
        echo.wait_ready()
        seconds = {"start": time.monotonic() - t_start}
        one = eight = tiny = None
        if "rpc" in sections:
            t0 = time.monotonic()
            one = one_client(daemon, echo, prompts, warmup, rounds, os.path.join(tmp, "lmdb"))
            seconds["rpc"] = time.monotonic() - t0
        if "rps8" in sections:
            t0 = time.monotonic()
            eight = eight_clients(daemon, echo_path, prompts8, per_worker, warmup8, echo_pairs, phases)
            seconds["rps8"] = time.monotonic() - t0
        if "kv" in sections or "attend" in sections:
            t0 = time.monotonic()
            tiny = tiny_sections(daemon, echo, sections, kv_reps, attend_reps)
            seconds["kv_attend"] = time.monotonic() - t0
        echo.close()
        status = daemon.stop()
        if status != 0:
            raise RuntimeError(f"the daemon stopped with status {status}:\n{daemon.log()}")
    import grpc
    import torch

    result["params"] = {
        "quick": quick, "sections": list(sections), "sync": "commit", "durability": "crash",
        "gsp": {"num_groups": groups, "prompts_per_group": per_group, "prompt_tokens": 2176},
        "gsp_layout": GSP_LAYOUT, "tiny_layout": TINY_LAYOUT,
        "gsp_pool_blocks": {"device": blocks[0], "host": blocks[1], "disk": blocks[2]},
        "rps_8": {"phases": phases, "requests_per_worker_per_phase": per_worker,
                  "warmup_per_worker_per_phase": warmup8, "echo_pairs_per_worker_per_phase": echo_pairs},
        "socket": "Unix, one per server, same directory kind (/tmp)",
        "server_cpus": sorted(args.server_cpus) if args.server_cpus else "all",
    }
    result["env"] = {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
                     "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                     "python": platform.python_version(), "grpc": grpc.__version__,
                     "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                     "seconds": round(time.monotonic() - t_start, 1),
                     "section_seconds": {k: round(v, 1) for k, v in seconds.items()}}
    rpc: dict = {}
    floor: dict = {}
    if one is not None:
        result["client"] = one.pop("client")
        rpc.update(one.pop("rpc"))
        floor.update(one.pop("floor"))
        result["one_client"] = one
    if eight is not None:
        rpc["rps_8"], floor["rps_8"] = eight["rpc"]["rps"], eight["floor"]["rps"]
        result["eight_clients"] = eight
    kv = (tiny or {}).get("kv")
    attend = (tiny or {}).get("attend")
    if kv is not None:
        floor["memcpy_gbps"], floor["grpc_bytes_gbps"] = kv.pop("memcpy_gbps"), kv.pop("grpc_bytes_gbps")
        result["kv"] = kv
    if attend is not None:
        floor["attend_us"] = attend.pop("floor_us")
        floor["attend_kernel_us"] = attend.pop("floor_kernel_us")
        floor["attend_by_threads"] = attend.pop("floor_by_threads")
        result["attend"] = attend
    result["rpc"], result["floor"] = rpc, floor
    result["ratios"] = {
        "rpc_p50_over_floor": _ratio(rpc.get("p50_us"), floor.get("p50_us")),
        "rps_8_over_floor": _ratio(rpc.get("rps_8"), floor.get("rps_8")),
        "kv_mapped_over_memcpy": _ratio((kv or {}).get("mapped_gbps"), floor.get("memcpy_gbps")),
        "kv_rpc_over_grpc_bytes": _ratio((kv or {}).get("rpc_gbps"), floor.get("grpc_bytes_gbps")),
        "attend_over_floor": _ratio((attend or {}).get("rpc_us"), floor.get("attend_us")),
    }
    result["targets"] = TARGETS
    return result


def save_json(result: dict, path: str | None) -> None:
    """Write ``result`` to ``path`` (a bench's ``--out``) as indented JSON; nothing when None."""
    if path:
        pathlib.Path(path).write_text(json.dumps(result, indent=2) + "\n")


def emit_json(result: dict, path: str | None) -> None:
    """``save_json``, then the same JSON on stdout (the rpc benches' last step)."""
    save_json(result, path)
    print(json.dumps(result, indent=2))


def print_profile(path: str, top: int = 30) -> None:
    stats = pstats.Stats(path, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--quick", action="store_true", help="small counts (a smoke test, < 1 min)")
    parser.add_argument("--out", metavar="PATH", help="also write the JSON object here")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--disk-blocks", type=int, default=262144,
                        help="disk tier of the gsp pool (0: none; crash durability is the host's)")
    parser.add_argument("--rounds", type=int, default=32, help="one-client rounds alternating daemon / floor")
    parser.add_argument("--phases", type=int, default=3, help="8-client phases alternating floor / daemon")
    parser.add_argument("--profile", metavar="PATH", help="run the daemon under cProfile, write here")
    parser.add_argument("--server-cpus", metavar="LIST", type=parse_cpus, default=None,
                        help="pin the daemon and the echo server alike to these CPUs (e.g. 1), as "
                             "systemd's CPUAffinity= would; default: not pinned")
    args = parser.parse_args(argv)
    args.sections = tuple(s for s in args.sections.split(",") if s)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.profile:
        args.profile = os.path.abspath(args.profile)
    result = run(args)
    save_json(result, args.out)
    print(json.dumps(result, indent=None if args.json else 2))
    if args.profile:
        print_profile(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
