"""One fresh vLLM process serving token-id prompts, greedy, with a chosen KV connector.

Runs INSIDE the vLLM venv (``.venv-vllm``, ``make vllm-venv``) and is imported nowhere in the
main venv; the main venv starts it through ``prefixd.tools.vllm_child``:

    .venv-vllm/bin/python -m prefixd.tools.vllm_run --model DIR --prompts P.json --out R.json \\
        [--connector none|prefixd|example] [--socket PATH] [--storage DIR] [--max-tokens N]

``P.json`` is a list of prompts, each a list of token ids (token ids, not text, so that every
process and every connector sees the very same tokens) or ``{"ids": [...], "max_tokens": N}``
(a longer request to kill mid-way). ``--tensor-parallel-size`` / ``--pipeline-parallel-size``
run vLLM's multiprocess executor (one worker process per rank, each bound to its share of the
cores). ``R.json`` gets one object:
``startup_s`` (``LLM(...)`` construction) and ``results``, one per prompt in order, with
``tokens`` (the new token ids), ``ttft_ms``, ``total_ms``, ``num_cached_tokens`` (vLLM's own
count of prompt tokens it did not compute) and ``logprobs`` (with ``--logprobs N``: per generated token, token id -> logprob of its top N)
and ``external_hit_tokens`` (the connector's share
of them, from vLLM's ``vllm:external_prefix_cache_hits`` counter; ``null`` when vLLM does not
report it). With ``--progress PATH`` a line ``started <i>`` is appended before prompt ``i`` is
submitted and ``done <i> <its result as JSON>`` after it (and ``ready {"startup_s", "block_size"}``
once vLLM has started) (the tests kill the process
mid-request on that signal, and still have the earlier prompts' results). With ``--gate DIR``
the process waits, after vLLM started, for a file ``DIR/go-<i>`` before prompt ``i`` and for
``DIR/go-end`` before it exits (the tests order two vLLM processes that run at once).

NOTE: prompts are submitted one at a time, so each one's time to first token is its own, not
the batch's. ``ttft_ms`` is vLLM's request metric ``first_token_latency`` (the frontend's
clock from the request's arrival to its first token; it needs ``disable_log_stats=False``),
else the wall time of the ``generate`` call that asked for the first token alone.

NOTE: vLLM's own prefix cache (APC) is off by default (``--prefix-caching`` turns it on): the
prompts share system prompts, and with APC a second question to a system would be served
from this process's own cache, so the run would not show what the connector brings. The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a second interpreter
importing vLLM costs tens of seconds on a small CPU host, and a ``kill -9`` of this pid is then a
kill of all of vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONNECTORS = ("none", "prefixd", "example")


def transfer_config(connector: str, *, socket: str | None, storage: str | None,
                    durability: str = "crash", connector_class: str | None = None):
    """vLLM's ``KVTransferConfig`` for ``connector`` (``None`` for ``"none"``);
    ``connector_class`` (``module:Class``) names a class to load instead of prefixd's own."""
    from vllm.config import KVTransferConfig

    if connector == "none":
        return None
    if connector == "prefixd":
        if not socket:
            raise SystemExit("--connector prefixd needs --socket (the daemon's Unix socket)")
        module, _, cls = (connector_class or "prefixd.client.vllm:PrefixdConnector").partition(":")
        return KVTransferConfig(kv_connector=cls or "PrefixdConnector",
                                kv_connector_module_path=module, kv_role="kv_both",
                                kv_connector_extra_config={"prefixd.socket": socket,
                                                           "prefixd.durability": durability})
    if connector == "example":
        if not storage:
            raise SystemExit("--connector example needs --storage (a directory for its files)")
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": storage})
    raise SystemExit(f"unknown --connector {connector!r}: one of {', '.join(CONNECTORS)}")


def cpu_binding(world: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world`` CPU workers: this process's allowed cores
    shared out in turn (``"0|1"`` for two on two cores). vLLM's own automatic binding refuses
    a host with fewer NUMA nodes than workers ("Not enough allowed NUMA nodes")."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // world)
    return "|".join(",".join(str(c) for c in (cpus[r * per:(r + 1) * per] or [cpus[r % len(cpus)]]))
                    for r in range(world))


def _external_hits(llm) -> int | None:
    """vLLM's running total of prompt tokens the connector supplied (None if not reported)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an older vLLM, or stats off: the count is unknown
        return None
    found = [m.value for m in metrics if m.name == "vllm:external_prefix_cache_hits"]
    return int(sum(found)) if found else None


def _progress(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def _wait_gate(gate: str | None, name: str, timeout_s: float = 600.0) -> None:
    if not gate:
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(gate, name)):
        if time.monotonic() > deadline:
            raise SystemExit(f"gate file {name} did not appear in {gate} within {timeout_s} s")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    kw = {}
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        kw.update(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                  distributed_executor_backend="mp")
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              enable_prefix_caching=args.prefix_caching, disable_log_stats=False, seed=0,
              kv_transfer_config=transfer_config(args.connector, socket=args.socket, storage=args.storage,
                                                 durability=args.durability, connector_class=args.connector_class),
              **kw)
    startup_s = time.perf_counter() - t0
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    _progress(args.progress, "ready " + json.dumps({"startup_s": round(startup_s, 2), "block_size": block_size}))
    logprobs = args.logprobs or None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            logprobs=logprobs)
    results = []
    for i, prompt in enumerate(prompts):
        ids = prompt["ids"] if isinstance(prompt, dict) else prompt
        step = params
        if isinstance(prompt, dict) and "max_tokens" in prompt:
            step = SamplingParams(temperature=0.0, max_tokens=prompt["max_tokens"], ignore_eos=True, logprobs=logprobs)
        _wait_gate(args.gate, f"go-{i}")
        before = _external_hits(llm)
        _progress(args.progress, f"started {i}")
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], step, use_tqdm=False)
        total_ms = (time.perf_counter() - t) * 1000
        after = _external_hits(llm)
        metrics = getattr(out, "metrics", None)
        ttft_s = getattr(metrics, "first_token_latency", 0.0) or 0.0
        if ttft_s <= 0:
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=list(ids))],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            ttft_s = time.perf_counter() - t
        results.append({
            "prompt_tokens": len(ids),
            "tokens": list(out.outputs[0].token_ids),
            "ttft_ms": round(ttft_s * 1000, 2),
            "total_ms": round(total_ms, 2),
            "num_cached_tokens": out.num_cached_tokens,
            "external_hit_tokens": None if before is None or after is None else after - before,
        })
        if logprobs:
            results[-1]["logprobs"] = [{str(tok): lp.logprob for tok, lp in step_lps.items()}
                                       for step_lps in out.outputs[0].logprobs or ()]
        _progress(args.progress, f"done {i} {json.dumps(results[-1])}")
    _wait_gate(args.gate, "go-end")
    return {"connector": args.connector, "startup_s": round(startup_s, 2),
            "block_size": block_size, "results": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefixd.tools.vllm_run", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model directory (python -m prefixd.tools.smollm2)")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--out", required=True, help="where the JSON result goes (vLLM logs to stdout)")
    p.add_argument("--connector", choices=CONNECTORS, default="none")
    p.add_argument("--socket", help="prefixd's socket (--connector prefixd)")
    p.add_argument("--durability", default="crash", help="prefixd commit durability: index, crash, power")
    p.add_argument("--storage", help="ExampleConnector's directory (--connector example)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="float32", help="compute and KV dtype (bfloat16 is emulated, slow, without AVX512)")
    p.add_argument("--block-size", type=int, help="vLLM's KV block size (default: vLLM's)")
    p.add_argument("--prefix-caching", action="store_true", help="turn vLLM's own prefix cache on")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's TP size (worker processes)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, help="vLLM's PP size")
    p.add_argument("--logprobs", type=int, default=0, help="record the top-N logprobs of every generated token")
    p.add_argument("--connector-class", help="module:Class of the prefixd connector (default: prefixd's own)")
    p.add_argument("--progress", help="append 'started i' / 'done i RESULT' lines here")
    p.add_argument("--gate", help="wait for DIR/go-<i> before prompt i and DIR/go-end before exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes a share of RAM
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if world > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(world))
    result = run(args)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
