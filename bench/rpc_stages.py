"""Where one client's gsp request goes beyond the floor of ``bench/rpc.py``, stage by stage.

Runs ``bench/rpc.py``'s one-client request (``open`` of a 2,176-token prompt, then ``release``
with commit at ``crash``, ``sync = "commit"``) against a daemon started through
``rpc_stage_probe.py`` (timestamps in the daemon), and after each request the floor's pieces
on the same thread: an echo of Open's sizes, one of Release's, one durable LMDB commit as
large as the request's records. Prints one JSON object of medians in microseconds:

- ``open``: ``client_to_handler``, ``handler`` (of which ``engine``), ``handler_to_client``,
  ``total``, and ``echo`` (the bare call of the same sizes);
- ``release``: ``client_to_handler``, ``handler_to_engine``, ``engine_to_flush`` (the commit's
  work before the WAL is asked), ``flush_to_woken`` (the committer past its wait),
  ``woken_to_txn``, ``txn`` (LMDB write transaction with its fsyncs), ``txn_to_resolved``,
  ``resolved_to_resumed`` (committer thread to the handler on the loop), ``resumed_to_out``,
  ``handler_to_client``, ``total``, ``echo``, ``lmdb_commit`` (the floor's);
- ``wal``: records per group, groups per request.

Usage: ``python bench/rpc_stages.py [--requests N] [--out PATH]``. Stamps are
``perf_counter_ns`` in both processes (CLOCK_MONOTONIC). One client: the i-th Open and Release
the daemon saw are the i-th request's.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def _med(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values) / 1000, 1) if values else None


def _client(daemon, echo, prompts, warmup: int, lmdb_dir: str) -> dict:
    import prefixd.client as pc
    from rpc import GSP_LAYOUT, _sizes
    from rpc_load import LmdbCommit

    clock = time.perf_counter_ns
    sizes = _sizes()
    open_req, release_req = echo.request(*sizes["open"]), echo.request(*sizes["release"])
    lmdb = None
    rows = []
    with pc.connect(daemon.socket, pc.KVLayout(**GSP_LAYOUT), name="bench-rpc-stages") as session:
        for i, prompt in enumerate(prompts):
            if i == warmup:
                records = daemon.request_record_bytes(GSP_LAYOUT["model_id"], 0)
                lmdb = LmdbCommit(lmdb_dir, max(1, records["median_bytes"] - 8))
            t0 = clock()
            seq = session.open(prompt)
            t1 = clock()
            session.release(seq, commit=True, durability="crash")
            t2 = clock()
            if lmdb is None:
                continue
            echo.call(open_req)
            t3 = clock()
            echo.call(release_req)
            t4 = clock()
            lmdb.commit()
            rows.append((t0, t1, t2, t3, t4, clock()))  # echo open: t2..t3; release: t3..t4
    lmdb.close()
    return {"rows": rows}


def _stages(rows, calls, groups, echo_open) -> dict:
    opens = [c for c in calls if c["m"] == "Open"][-len(rows):]
    releases = [c for c in calls if c["m"] == "Release"][-len(rows):]
    txn_in = [g["txn_in"] for g in groups]
    o: dict[str, list] = {}
    r: dict[str, list] = {}
    for (t0, t1, t2, t3, t4, t5), op, rel, e_open in zip(rows, opens, releases, echo_open):
        o.setdefault("client_to_handler", []).append(op["t_in"] - t0)
        o.setdefault("handler", []).append(op["t_out"] - op["t_in"])
        o.setdefault("engine", []).append(op["engine_out"] - op["engine_in"])
        o.setdefault("handler_to_client", []).append(t1 - op["t_out"])
        o.setdefault("total", []).append(t1 - t0)
        o.setdefault("echo", []).append(e_open)
        r.setdefault("client_to_handler", []).append(rel["t_in"] - t1)
        r.setdefault("handler_to_engine", []).append(rel["engine_in"] - rel["t_in"])
        r.setdefault("engine_to_flush", []).append(rel["flush"] - rel["engine_in"])
        g = groups[min(bisect.bisect_left(txn_in, rel["flush"]), len(groups) - 1)]
        r.setdefault("flush_to_woken", []).append(g["woken"] - rel["flush"] if g["woken"] else None)
        r.setdefault("woken_to_txn", []).append(g["txn_in"] - g["woken"] if g["woken"] else None)
        r.setdefault("txn", []).append(g["txn_out"] - g["txn_in"])
        r.setdefault("txn_to_resolved", []).append(rel["resolved"] - g["txn_out"])
        r.setdefault("resolved_to_resumed", []).append(rel["resumed"] - rel["resolved"])
        r.setdefault("resumed_to_out", []).append(rel["t_out"] - rel["resumed"])
        r.setdefault("handler_to_client", []).append(t2 - rel["t_out"])
        r.setdefault("total", []).append(t2 - t1)
        r.setdefault("echo", []).append(t4 - t3)
        r.setdefault("lmdb_commit", []).append(t5 - t4)
    return {"open": {k: _med(v) for k, v in o.items()}, "release": {k: _med(v) for k, v in r.items()}}


def run(requests: int, warmup: int) -> dict:
    from prefixd.tools.workloads import gsp
    from rpc_daemon import BenchDaemon
    from rpc_echo import EchoClient, EchoServer

    prompts = [r.prompt for r in gsp(-(-(requests + warmup) // 32), 32)][:requests + warmup]
    with tempfile.TemporaryDirectory(prefix="pdb-stages-", dir="/tmp") as tmp:
        out = os.path.join(tmp, "stages.json")
        os.environ["PREFIXD_STAGES_OUT"] = out
        load = os.getloadavg()
        with EchoServer(os.path.join(tmp, "echo.sock")) as echo_server, \
                BenchDaemon((131072, 131072, 262144), ("tiny-llama", 256),
                            entry=[str(BENCH / "rpc_stage_probe.py")]) as daemon:
            echo = EchoClient(echo_server.path)
            echo.wait_ready()
            rows = _client(daemon, echo, prompts, warmup, os.path.join(tmp, "lmdb"))["rows"]
            echo.close()
            if daemon.stop() != 0:
                raise RuntimeError(f"the daemon stopped badly:\n{daemon.log()}")
        trace = json.loads(pathlib.Path(out).read_text())
    echo_open = [t3 - t2 for (_t0, _t1, t2, t3, _t4, _t5) in rows]
    result = {"bench": "rpc_stages", "requests": len(rows), "warmup": warmup,
              "load_avg": [round(x, 2) for x in load],
              **_stages(rows, trace["calls"], trace["groups"], echo_open)}
    groups = trace["groups"][-len(rows):]
    result["wal"] = {"records_per_group": _med([g["records"] * 1000 for g in groups]),
                     "groups": len(trace["groups"])}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--out", metavar="PATH", help="also write the JSON object here")
    args = parser.parse_args(argv)
    result = run(args.requests, args.warmup)
    text = json.dumps(result, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
