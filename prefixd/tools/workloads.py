"""Benchmark workloads (DESIGN.md "Benchmarks"): token ids only, seeded, vocab 128256.

A workload is a list of ``Request(prompt, output)`` with both as packed int32 ``bytes``, in
the order they are served. The same definitions are used by every benchmark and the demo.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import xxhash

VOCAB = 128256


class Request(NamedTuple):
    prompt: bytes
    output: bytes


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def gsp(num_groups: int = 64, prompts_per_group: int = 32, system_len: int = 2048,
        question_len: int = 128, output_len: int = 256, seed: int = 0) -> list[Request]:
    """SGLang bench_serving's generated-shared-prefix: shared system prompts, unique questions."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(num_groups):
        system = _tokens(rng, system_len)
        for _ in range(prompts_per_group):
            prompt = np.concatenate([system, _tokens(rng, question_len)])
            reqs.append(Request(prompt.astype("<i4").tobytes(), _tokens(rng, output_len).astype("<i4").tobytes()))
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


def multiturn(num_groups: int = 64, prompts_per_group: int = 32, system_len: int = 2048,
              question_len: int = 128, output_len: int = 256, rounds: int = 4,
              interleave: int = 64, seed: int = 0) -> list[Request]:
    """Each (group, prompt) is a ``rounds``-round conversation; ``interleave`` of them run
    round-robin at a time. Round t's prompt is the system prompt, every earlier question and
    answer, and question t."""
    rng = np.random.default_rng(seed)
    convs = []
    for _ in range(num_groups):
        system = _tokens(rng, system_len)
        for _ in range(prompts_per_group):
            qs = [_tokens(rng, question_len) for _ in range(rounds)]
            ans = [_tokens(rng, output_len) for _ in range(rounds)]
            convs.append((system, qs, ans))
    order = rng.permutation(len(convs))
    convs = [convs[i] for i in order]
    reqs = []
    for start in range(0, len(convs), interleave):
        wave = convs[start:start + interleave]
        for t in range(rounds):
            for system, qs, ans in wave:
                parts = [system]
                for i in range(t):
                    parts += [qs[i], ans[i]]
                parts.append(qs[t])
                reqs.append(Request(np.concatenate(parts).astype("<i4").tobytes(),
                                    ans[t].astype("<i4").tobytes()))
    return reqs


WORKLOADS = {"gsp": gsp, "multiturn": multiturn}


def working_set_tokens(reqs: list[Request], block_size: int = 16) -> int:
    """Distinct tokens of every prompt + output (DESIGN.md: gsp 64 × 32 → 917,504)."""
    seen = set()
    total = 0
    for r in reqs:
        full = r.prompt + r.output
        h = b""
        bb = block_size * 4
        for start in range(0, len(full), bb):
            h = xxhash.xxh3_128_digest(h + full[start:start + bb])
            if h not in seen:
                seen.add(h)
                total += (min(len(full), start + bb) - start) // 4
    return total


def ideal_hit_rate(reqs: list[Request], block_size: int = 16) -> float:
    """Hit rate of an infinite cache: whole blocks of each prompt cached by an earlier request
    (its prompt + output − 1 committed), at most ``len(prompt) − 1`` tokens."""
    bb = block_size * 4
    seen: set[bytes] = set()
    hit = total = 0
    for r in reqs:
        n = len(r.prompt) // 4
        total += n
        h = b""
        limit = ((n - 1) // block_size) * bb
        for start in range(0, limit, bb):
            h = xxhash.xxh3_128_digest(h + r.prompt[start:start + bb])
            if h not in seen:
                break
            hit += block_size
        full = r.prompt + r.output[:-4]
        h = b""
        for start in range(0, (len(full) // bb) * bb, bb):
            h = xxhash.xxh3_128_digest(h + full[start:start + bb])
            seen.add(h)
    return hit / total
