"""One end-to-end run of a real model through a live daemon: before, kill -9, restart, after.

``run_requests`` serves ``ChatRequest``s (``chat_requests.py``) system by system. Each request
is generated twice, back to back: with transformers' own cache (no reuse: the baseline) and
through the prefixd session; alternating them puts a loaded host's noise on both. Questions
numbered below ``restart_at`` are served first; then the daemon is killed with SIGKILL and
started again on the same state, and the rest are served. Each prefixd request is of a kind:

- ``cold``: the first request to its system prompt (nothing cached yet);
- ``after_restart``: the first request to its system prompt after the restart (its prefix is
  a hit only because the daemon's index and KV survived the crash);
- ``warm``: every other request (its system prompt was served before by this daemon run).

Used by ``bench/e2e.py`` (numbers, JSON, plot) and ``prefixd.tools.demo_model`` (``make demo``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, NamedTuple

from prefixd.tools.chat_requests import ChatRequest, Timed, timed_generate
from prefixd.tools.daemon_proc import DaemonProc

MODEL_ID = "smollm2-135m-instruct"


class Row(NamedTuple):
    request: ChatRequest
    kind: str            # "cold" | "warm" | "after_restart"
    prefixd: Timed
    no_cache: Timed

    @property
    def equal(self) -> bool:
        return self.prefixd.tokens == self.no_cache.tokens

    def as_dict(self) -> dict:
        return {"system": self.request.system, "question": self.request.question, "kind": self.kind,
                "prompt_tokens": len(self.request.input_ids), "cached_tokens": self.prefixd.cached_tokens,
                "ttft_ms": round(self.prefixd.ttft_s * 1000, 1),
                "ttft_no_cache_ms": round(self.no_cache.ttft_s * 1000, 1),
                "total_ms": round(self.prefixd.total_s * 1000, 1),
                "total_no_cache_ms": round(self.no_cache.total_s * 1000, 1),
                "new_tokens": len(self.prefixd.tokens), "tokens_equal": self.equal}


class RunResult(NamedTuple):
    rows: list[Row]
    restart_at_row: int    # rows served before the kill -9
    restart_s: float       # daemon start to SERVING after the kill (its recovery)
    reconnect_s: float     # the client session's recovery, measured by a Stats call after it
    stats: dict            # the daemon's Stats at the end (Prometheus-style names)
    stop_code: int         # the daemon's exit status on SIGTERM at the end (0: clean)


def run_requests(model, requests: list[ChatRequest], daemon: DaemonProc, *, new_tokens: int, restart_at: int,
                 on_row: Callable[[Row, int, int], None] | None = None,
                 on_restart: Callable[[float, float], None] | None = None) -> RunResult:
    """Serve ``requests`` through ``daemon`` (started here) and stop it cleanly at the end.

    Args:
        restart_at: questions ``< restart_at`` of every system go before the kill -9, the rest after.
        on_row: called after each request with (row, index, total), for progress output.
        on_restart: called after the restart with (restart_s, reconnect_s).
    Raises:
        DaemonFailed: the daemon did not start, or did not stop cleanly.
    """
    import prefixd.client as pc
    from prefixd.client.hf import layout_for

    before = [r for r in requests if r.question < restart_at]
    after = [r for r in requests if r.question >= restart_at]
    daemon.start()
    rows: list[Row] = []

    def serve(session, reqs: list[ChatRequest], first_kind: str) -> None:
        # the first request to each system is ``first_kind``, the others to it ``warm``
        seen: set[int] = set()
        for req in reqs:
            kind = "warm" if req.system in seen else first_kind
            seen.add(req.system)
            rows.append(_serve(model, session, req, kind, new_tokens))
            if on_row:
                on_row(rows[-1], len(rows), len(requests))

    with pc.connect(daemon.socket, layout_for(model, MODEL_ID), "e2e", mapped=True) as session:
        _warm_up(model, session, new_tokens)
        serve(session, before, "cold")
        restart_at_row = len(rows)
        daemon.kill9()
        restart_s = daemon.start()
        t0 = time.perf_counter()
        session.stats()  # idempotent: waits for the session's own recovery, retried through it
        reconnect_s = time.perf_counter() - t0
        if on_restart:
            on_restart(restart_s, reconnect_s)
        serve(session, after, "after_restart")
        stats = session.stats()
    stop_code = daemon.stop()
    return RunResult(rows, restart_at_row, restart_s, reconnect_s, stats, stop_code)


def set_threads(requested: int | None) -> int:
    """Set torch's intra-op threads: ``requested``, else 1 on a host busier than its cores.

    NOTE: on a host busier than its cores, a SmolLM2 forward with torch's threads takes
    several times as long as with one: its threads spin-wait for each other while other
    processes hold the cores. An idle host keeps torch's default (every core).
    """
    import torch

    if requested:
        torch.set_num_threads(requested)
    elif os.getloadavg()[0] > (os.cpu_count() or 1):
        torch.set_num_threads(1)
    return torch.get_num_threads()


def summarize(result: RunResult) -> dict:
    """The headline numbers: median TTFTs by kind, ratios to no-cache, equality, tokens/s."""
    rows = result.rows
    out: dict = {}
    no_cache_all = [r.no_cache.ttft_s for r in rows]
    out["ttft_no_cache_ms"] = _ms(statistics.median(no_cache_all))
    for kind in ("cold", "warm", "after_restart"):
        mine = [r for r in rows if r.kind == kind]
        out[f"ttft_{kind}_ms"] = _ms(statistics.median(r.prefixd.ttft_s for r in mine)) if mine else None
        out[f"n_{kind}"] = len(mine)
    for key, kind in (("warm_ratio", "warm"), ("restart_ratio", "after_restart"), ("cold_ratio", "cold")):
        mine = [r for r in rows if r.kind == kind]
        out[key] = (round(statistics.median(r.prefixd.ttft_s for r in mine)
                          / statistics.median(r.no_cache.ttft_s for r in mine), 4) if mine else None)
    out["tokens_equal"] = all(r.equal for r in rows)
    out["requests_unequal"] = [i for i, r in enumerate(rows) if not r.equal]
    out["decode_tokens_per_s"] = _decode_rate(r.prefixd for r in rows)
    out["decode_tokens_per_s_no_cache"] = _decode_rate(r.no_cache for r in rows)
    out["tokens_per_s"] = _overall_rate(r.prefixd for r in rows)
    out["tokens_per_s_no_cache"] = _overall_rate(r.no_cache for r in rows)
    return out


def _serve(model, session, req: ChatRequest, kind: str, new_tokens: int) -> Row:
    no_cache = timed_generate(model, req.input_ids, new_tokens)
    with_prefixd = timed_generate(model, req.input_ids, new_tokens, session=session)
    return Row(req, kind, with_prefixd, no_cache)


def _warm_up(model, session, new_tokens: int) -> None:
    """One short generate each way on a prompt no request shares: first-call costs out of the numbers."""
    ids = list(range(1000, 1040))
    timed_generate(model, ids, min(new_tokens, 4))
    timed_generate(model, ids, min(new_tokens, 4), session=session)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _decode_rate(timings) -> float:
    rates = [(len(t.tokens) - 1) / (t.total_s - t.ttft_s) for t in timings
             if len(t.tokens) > 1 and t.total_s > t.ttft_s]
    return round(statistics.median(rates), 1) if rates else 0.0


def _overall_rate(timings) -> float:
    timings = list(timings)
    return round(sum(len(t.tokens) for t in timings) / sum(t.total_s for t in timings), 1)
