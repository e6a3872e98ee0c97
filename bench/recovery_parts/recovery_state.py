"""The state directories ``bench/recovery.py`` restarts: the traffic that fills them and the
builds that leave them as a crash would.

``Traffic`` is chat-shaped (shared system prompts of 8-150 blocks, conversations branching off
them, further turns branching off those); ``LongTraffic`` is ~12k-token prompts (a shared
system prompt and a new document, or a new question on a document already served). Both are
seeded, so a build is the same every run. Each request goes through ``DurableCache`` itself
(``serve``: open, commit at durability ``index``, release), the code that serves clients.

``build`` fills a cache to n disk blocks (``fill_disk``), takes a checkpoint, then appends a
tail after it: a forced number of records, or (``default_tail``) as many as the engine's
default checkpoint trigger allows before it fires. ``build_long`` serves long prompts under
the engine's own trigger. Both close without a final checkpoint. ``bench/faults.py`` and the
daemon's tests fill their pools with the same traffic (``LAYOUT``, ``Traffic``, ``fill_disk``).

The KV layout is tiny (1 layer, 1 head, head_dim 2, float32, 16 tokens per block: 256 B per
block), so pool files stay small: the bench is about the index, not the bytes.
"""

from __future__ import annotations

import inspect
import time

import numpy as np

from prefixd.api.layout import KVLayout
from prefixd.engine.durable import DurableCache
from prefixd.wal import Kind

BLOCK_SIZE = 16
LAYOUT = KVLayout("bench-tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32",
                  block_size=BLOCK_SIZE)
DEVICE_BLOCKS = 2048
HOST_BLOCKS = 8192
VOCAB = 128256


class Traffic:
    """Seeded request generator: system prompts, conversations branching off them, turns."""

    def __init__(self, seed: int, num_systems: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.systems = [self.tokens(self.run_len()) for _ in range(num_systems)]
        self.convs: list[bytes] = []  # prompts served so far (prefixes to continue)

    def run_len(self, lo: int = 8, hi: int = 150) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def tokens(self, num_blocks: int) -> bytes:
        return self.rng.integers(0, VOCAB, num_blocks * BLOCK_SIZE, dtype="<i4").tobytes()

    def next_prompt(self, lo: int, hi: int, p_new: float) -> bytes:
        """A new conversation on a system prompt, or one more turn of an earlier one."""
        rng = self.rng
        if not self.convs or rng.random() < p_new:
            base = self.systems[int(rng.integers(len(self.systems)))]
        else:
            base = self.convs[int(rng.integers(len(self.convs)))]
            if len(base) > 600 * BLOCK_SIZE * 4:  # keep prompts within the device tier
                base = base[: 300 * BLOCK_SIZE * 4]
        prompt = base + self.tokens(self.run_len(lo, hi)) + self.tokens(1)[:4 * 3]  # + 3 loose tokens
        self.convs.append(prompt)
        if len(self.convs) > 4096:
            self.convs = self.convs[-2048:]
        return prompt


class LongTraffic:
    """Long prompts (~``prompt_tokens``): a shared system prompt and a new document, or a new
    question about a document already served (a long cached prefix)."""

    def __init__(self, seed: int, prompt_tokens: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.system = self.tokens(64)
        self.doc_blocks = max(1, prompt_tokens // BLOCK_SIZE - 64 - 16)
        self.docs: list[bytes] = []

    def tokens(self, num_blocks: int) -> bytes:
        return self.rng.integers(0, VOCAB, num_blocks * BLOCK_SIZE, dtype="<i4").tobytes()

    def next_prompt(self) -> bytes:
        rng = self.rng
        if self.docs and rng.random() < 0.3:
            base = self.docs[int(rng.integers(len(self.docs)))]
        else:
            base = self.system + self.tokens(self.doc_blocks)
            self.docs.append(base)
            if len(self.docs) > 512:
                self.docs = self.docs[-256:]
        return base + self.tokens(int(rng.integers(4, 17))) + self.tokens(1)[:4 * 3]


def serve(dc: DurableCache, prompt: bytes) -> None:
    """One request: open ``prompt``, commit it at durability ``index``, release it."""
    seq = dc.open(prompt)
    dc.commit(seq.id, "index").result()
    dc.release(seq.id)


def fill_disk(dc: DurableCache, traffic: Traffic, n: int) -> int:
    """Serve ``traffic``'s chat prompts (runs of 8-150 blocks, half of them new conversations)
    until ``n`` blocks are on ``dc``'s disk tier or queued for it, spilling the queue every 64
    runs and at the end. Returns the requests served.

    Raises:
        RuntimeError: 5,000 requests in a row added no disk block (make the disk tier larger
        than ``n``, with room for the evictions' headroom).
    """
    tree, tiering = dc.cache.tree, dc.cache.tiering
    requests = best = best_at = 0
    while (have := tree.num_blocks_in[2] + sum(node.num_blocks for node in tiering.pending_disk)) < n:
        serve(dc, traffic.next_prompt(8, 150, p_new=0.5))
        requests += 1
        if len(tiering.pending_disk) >= 64:
            dc.spill()
        if have > best:
            best, best_at = have, requests
        elif requests - best_at > 5000:  # a bounded loop: the disk tier stopped filling
            raise RuntimeError(f"build stalled at {have} of {n} disk blocks (disk tier "
                               f"{dc.cache.allocators[2].num_slots}) after {requests} requests: "
                               "something keeps disk slots empty")
    dc.spill()
    return requests


def default_trigger() -> tuple[int, int]:
    """The engine's default checkpoint trigger: ``(checkpoint_records, checkpoint_blocks)``."""
    params = inspect.signature(DurableCache).parameters
    return params["checkpoint_records"].default, params["checkpoint_blocks"].default


def build(state: str, shm: str, n: int, tail: int | None, seed: int = 0) -> dict:
    """Build a state dir: n blocks in the checkpoint, then a tail after it: ``tail`` records
    exactly, or (``tail=None``) as long as the engine's default checkpoint trigger allows, up
    to the engine call that makes it fire (its checkpoint is skipped, as a crash right then
    would skip it)."""
    disk = n + max(n // 20, 20_000)
    sizes = (DEVICE_BLOCKS, HOST_BLOCKS, disk)
    traffic = Traffic(seed, num_systems=max(8, n // 5000))
    t0 = time.perf_counter()
    dc = DurableCache(state, LAYOUT, sizes, shm_dir=shm, sync="none", checkpoint_records=1 << 60,
                      checkpoint_blocks=1 << 60, spill_blocks=4096)
    tree = dc.cache.tree
    requests = fill_disk(dc, traffic, n)
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ckpt_lsn = dc.checkpoint()
    checkpoint_write_s = time.perf_counter() - t1
    ckpt_blocks = list(tree.num_blocks_in)
    ckpt_nodes = sum(1 for _ in tree.nodes())
    # the tail: shorter new turns (a chat's next question), re-opens of cached prefixes
    counts: dict[str, int] = {}
    tail_requests = 0
    if tail is None:
        tail_requests = default_tail(dc, traffic)
    else:
        while dc.wal.stats().next_lsn - 1 - ckpt_lsn < tail - 40:
            serve(dc, traffic.next_prompt(1, 24, p_new=0.3))
            tail_requests += 1
            if tail_requests % 50 == 0:
                dc.spill()
        dc._log()
        extra = tail - (dc.wal.stats().next_lsn - 1 - ckpt_lsn)
        for _ in range(max(extra, 0)):  # top up to exactly ``tail`` with cheap lookups turned opens
            seq = dc.open(traffic.systems[0][: 4 * BLOCK_SIZE * 2 + 4])
            dc.release(seq.id)
            if dc.wal.stats().next_lsn - 1 - ckpt_lsn >= tail:
                break
    dc._log()
    tail_records, tail_blocks = log_tail(dc, ckpt_lsn, counts)
    final_blocks = list(tree.num_blocks_in)
    dc.close()
    return {"sizes": list(sizes), "tail": "default_trigger" if tail is None else f"{tail} records",
            "build_s": round(build_s, 2), "build_requests": requests,
            "checkpoint_write_s": round(checkpoint_write_s, 3),
            "checkpoint_blocks_by_tier": ckpt_blocks, "checkpoint_nodes": ckpt_nodes,
            "tail_records": tail_records, "tail_blocks": tail_blocks, "tail_requests": tail_requests,
            "tail_kinds": counts, "blocks_by_tier_at_close": final_blocks}


def default_tail(dc: DurableCache, traffic: Traffic) -> int:
    """Serve tail traffic under the engine's default checkpoint trigger until it fires; the
    checkpoint it asks for is not taken (a crash before it leaves this tail). Returns the
    requests served (the last one may stop half way: open, commit or release)."""
    dc.checkpoint_records, dc.checkpoint_blocks = default_trigger()
    fired = []
    dc.on_checkpoint_due = lambda: fired.append(1)  # the trigger's call, skipped (see the docstring)
    requests = 0
    while not fired:
        seq = dc.open(traffic.next_prompt(1, 24, p_new=0.3))
        if not fired:
            dc.commit(seq.id, "index").result()
        if not fired:
            dc.release(seq.id)
        requests += 1
        if not fired and requests % 50 == 0:
            dc.spill()
    return requests


def log_tail(dc: DurableCache, after_lsn: int, counts: dict | None = None) -> tuple[int, int]:
    """``(records, blocks named by block records)`` in the log after ``after_lsn``: every record
    logged so far is committed first (replay reads committed records; with ``sync="none"``
    the committer is still behind), as the close that follows commits them."""
    dc._log()
    dc.wal.commit_now()
    records = blocks = 0
    block_kinds = (Kind.BLOCK_PUT, Kind.BLOCK_MOVE, Kind.BLOCK_DROP)
    for rec in dc.wal.replay(after_lsn):
        records += 1
        if rec.kind in block_kinds:
            blocks += rec.fields[1]
        if counts is not None:
            counts[rec.kind.name] = counts.get(rec.kind.name, 0) + 1
    return records, blocks


def build_long(state: str, shm: str, n: int, prompt_tokens: int, checkpoint_blocks: int,
               seed: int = 0) -> dict:
    """Serve long prompts with the engine's own checkpoint trigger until about ``n`` blocks
    went to disk and a third more (the disk tier full and evicting), then close without a
    checkpoint: what a crash would leave."""
    sizes = (DEVICE_BLOCKS, HOST_BLOCKS, n)
    traffic = LongTraffic(seed, prompt_tokens)
    dc = DurableCache(state, LAYOUT, sizes, shm_dir=shm, sync="none", checkpoint_blocks=checkpoint_blocks)
    checkpoints = []

    def counted() -> None:  # the trigger's checkpoint, taken and timed
        t = time.perf_counter()
        dc.checkpoint()
        checkpoints.append(time.perf_counter() - t)

    dc.on_checkpoint_due = counted
    t0 = time.perf_counter()
    requests = stored = 0
    while stored < n * 4 // 3:
        before = dc.cache.stats.committed_blocks
        serve(dc, traffic.next_prompt())
        stored += dc.cache.stats.committed_blocks - before
        requests += 1
    serve_s = time.perf_counter() - t0
    dc._log()
    ckpt_lsn = dc.wal.with_checkpoint(lambda lsn, index, seqs: lsn)
    tail_records, tail_blocks = log_tail(dc, ckpt_lsn)
    final_blocks = list(dc.cache.tree.num_blocks_in)
    dc.close()
    return {"sizes": list(sizes), "checkpoint_blocks": checkpoint_blocks, "requests": requests,
            "blocks_committed": stored, "serve_s": round(serve_s, 2),
            "checkpoints": len(checkpoints), "checkpoint_s_total": round(sum(checkpoints), 2),
            "tail_records": tail_records, "tail_blocks": tail_blocks,
            "blocks_by_tier_at_close": final_blocks}
