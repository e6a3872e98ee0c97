"""The second half of ``make demo``: serve with the durable cache, ``kill -9`` it, recover.

A child process opens a ``DurableCache`` (device, host and disk tiers, WAL in LMDB) in a
temporary state directory, serves a small ``gsp`` workload writing real KV bytes (each token's
value derived from its whole prefix, as real KV is), commits at ``crash`` durability, reports
each acknowledged commit, and is killed with SIGKILL. The parent recovers the state directory
and replays the prompts: every acknowledged prefix must be a hit whose bytes are exactly right.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from prefixd.api.layout import KVLayout
from prefixd.engine.durable import DurableCache
from prefixd.tools.workloads import gsp

LAYOUT = KVLayout("demo", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
SIZES = (256, 1024, 8192)


def _workload():
    return gsp(num_groups=8, prompts_per_group=8, system_len=512, question_len=64, output_len=64, seed=7)


def _values(tokens: np.ndarray) -> np.ndarray:
    """One float per token, a function of every token up to it (exact in float32)."""
    h = np.cumsum((tokens.astype(np.int64) * 2654435761) % 1000003) % (1 << 20)
    return h.astype(np.float32)


def _kv(tokens: np.ndarray, start: int) -> torch.Tensor:
    """The KV of tokens ``start ..``: ``[num_layers, 2, n, num_kv_heads, head_dim]``, each
    token's value in every lane."""
    vals = torch.from_numpy(_values(tokens)[start:])
    shape = (LAYOUT.num_layers, 2, len(vals), LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return vals.view(1, 1, -1, 1, 1).expand(shape)


def _check_kv(dc: DurableCache, seq, tokens: np.ndarray, n: int) -> bool:
    return bool(torch.equal(dc.read_kv(seq, 0, n), _kv(tokens[:n], 0)))


def child(state_dir: str, shm_dir: str) -> None:
    dc = DurableCache(state_dir, LAYOUT, SIZES, shm_dir=shm_dir)
    for i, req in enumerate(_workload()):
        tokens = np.frombuffer(req.prompt + req.output[:-4], "<i4")
        seq = dc.open(req.prompt)
        dc.extend(seq.id, req.output[:-4])
        dc.write_kv(seq, seq.cached_tokens, _kv(tokens, seq.cached_tokens))
        dc.commit(seq.id, "crash").result()
        dc.release(seq.id)
        print(f"acked {i}", flush=True)
    time.sleep(3600)  # wait for the kill


def run() -> list[tuple[str, str]]:
    reqs = _workload()
    with tempfile.TemporaryDirectory(prefix="prefixd-demo-") as tmp:
        state, shm = os.path.join(tmp, "state"), os.path.join(tmp, "shm")
        os.makedirs(shm)
        proc = subprocess.Popen([sys.executable, "-m", "prefixd.tools.demo_kill9", state, shm],
                                stdout=subprocess.PIPE, text=True)
        acked = 0
        t0 = time.perf_counter()
        for line in proc.stdout:
            acked += 1
            if acked == len(reqs):
                break
        serve_s = time.perf_counter() - t0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if acked < len(reqs):
            raise RuntimeError(f"the serving child died after {acked} acknowledgements (exit {proc.returncode})")
        dc = DurableCache(state, LAYOUT, SIZES, shm_dir=shm)
        try:
            rec = dc.recovery
            hits = total = good = 0
            for req in reqs:
                tokens = np.frombuffer(req.prompt + req.output[:-4], "<i4")
                seq = dc.open(tokens.tobytes() + b"\x00\x00\x00\x00")
                want = len(tokens) // LAYOUT.block_size * LAYOUT.block_size
                total += want
                hits += seq.cached_tokens
                good += _check_kv(dc, seq, tokens, seq.cached_tokens) if seq.cached_tokens else 1
                dc.release(seq.id)
            dc.check_invariants()
        finally:
            dc.close()
    return [
        ("served before kill -9", f"{acked} requests acknowledged at 'crash' durability in {serve_s:.1f} s"),
        ("recovery", f"ready in {rec['ready_s'] * 1000:.0f} ms: {rec['records_replayed']} log records "
                     f"replayed, blocks host/disk {rec['blocks'][1]}/{rec['blocks'][2]}"),
        ("after restart", f"{hits:,} of {total:,} committed tokens are hits ({hits / total:.1%})"),
        ("bytes checked", f"{good} of {len(reqs)} requests' KV byte-identical"),
    ]


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
