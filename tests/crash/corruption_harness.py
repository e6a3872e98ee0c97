"""The harness the corruption tables run through: the state directory they damage, what serving
it must give, and the byte-level damage they apply.

`build` commits ``PROMPTS`` at ``power`` into a fresh state directory, closes it and deletes the
shm pools (as after a reboot), so the disk tier holds the only copy of the KV bytes; the
`Built` it returns says where each prompt's blocks lie in the disk pool file. `serve_all`
opens every prompt again and checks every byte served. `flip_bit` and `flip_token_bits` damage
a closed file in place.

The tables that use it: ``test_corruption_disk`` (the disk pool file), ``test_corruption_lmdb``
(the log's LMDB file); ``test_verify`` runs ``prefixctl verify`` over both, and
``test_bitflip_fuzz`` flips random bits in a state directory built from the same prompts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from prefixd.api.layout import KVLayout
from prefixd.cache.node import DISK, path_to
from prefixd.engine.durable import DurableCache
from prefixd.storage.poolfile import DATA_OFFSET
from tests.cache.helpers import StoreTokens

REPO = Path(__file__).resolve().parents[2]
BS = 4
# 8 KiB blocks (2 layers x K/V x 4 tokens x 2 heads x 64 dims x fp32): a 4 KiB page lies inside a slot
LAYOUT = KVLayout("corruption-test", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=BS)
SIZES = (64, 16, 64)
PAGE = 4096
BASE = 7_000_000  # token ids: their int32 bytes are searched for in the LMDB file


def _prompts() -> list[list[int]]:
    """Four unrelated prompts of 3 whole blocks (+1 token), and one that shares two blocks of the
    second (so damage there must also cut the sharer)."""
    out = [[BASE + 1000 * p + i for i in range(3 * BS + 1)] for p in range(4)]
    out.append(out[1][: 2 * BS] + [BASE + 9000 + i for i in range(2 * BS + 1)])
    return out


PROMPTS = _prompts()


class Built(NamedTuple):
    state_dir: str
    shm_dir: str
    disk_path: str
    block_bytes: int
    slots: list[list[int]]  # per prompt: the disk slot of each whole block, in order

    def offset(self, slot: int) -> int:
        return DATA_OFFSET + slot * self.block_bytes


def open_cache(state_dir: str, shm_dir: str, **kw) -> DurableCache:
    return DurableCache(state_dir, LAYOUT, SIZES, shm_dir=shm_dir, reclaim_grace_s=0.0, **kw)


def commit_prompts(dc: DurableCache, prompts: list[list[int]], durability: str = "power") -> None:
    """Open each prompt, write its KV (`StoreTokens`), commit it at `durability` (waiting for
    the acknowledgement) and release it."""
    pool = StoreTokens(dc.store, dc.layout.block_size)
    for tokens in prompts:
        seq = dc.open(tokens)
        pool.write(seq.block_table, tokens, seq.cached_tokens)
        dc.commit(seq.id, durability).result()
        dc.release(seq.id)


def _disk_slots(dc: DurableCache, tokens: list[int]) -> list[int]:
    """The disk slot of each whole block of ``tokens`` (read off the tree)."""
    want = np.asarray(tokens, "<i4").tobytes()
    by_block: dict[int, int] = {}
    for node in dc.cache.tree.nodes():
        prefix = b"".join(n.tokens for n in path_to(node))
        if node.slots[DISK] is None or not want.startswith(prefix):
            continue
        first = len(prefix) // (4 * BS) - node.num_blocks
        for k, slot in enumerate(node.slots[DISK]):
            by_block[first + k] = slot
    n = (len(tokens) - 1) // BS
    assert sorted(by_block) == list(range(n)), f"prompt not wholly on disk: {by_block}"
    return [by_block[b] for b in range(n)]


def build(root: Path) -> Built:
    """Commit every prompt at ``power``, close, and drop the shm pools (as after a reboot)."""
    state, shm = root / "state", root / "shm"
    shm.mkdir(parents=True)
    dc = open_cache(str(state), str(shm))
    try:
        commit_prompts(dc, PROMPTS)
        slots = [_disk_slots(dc, t) for t in PROMPTS]
        disk = dc.store.pool(DISK)
        built = Built(str(state), str(shm), disk.path, disk.block_bytes, slots)
    finally:
        dc.close()
    for name in os.listdir(shm):
        os.unlink(shm / name)
    assert all(v % (1 << 20) for t in PROMPTS for v in StoreTokens.values(t)), "a zero value hides damage"
    return built


def serve_all(dc: DurableCache) -> list[int]:
    """Open every prompt; check the bytes of every block served; returns blocks served each."""
    pool = StoreTokens(dc.store, BS)
    served = []
    for tokens in PROMPTS:
        seq = dc.open(tokens)
        n = seq.cached_tokens // BS
        pool.check(seq.block_table[:n], tokens[: n * BS])
        dc.release(seq.id)
        served.append(n)
    return served


# -- byte-level damage ------------------------------------------------------------------------------

def flip_bit(path: str, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at `offset` of the file at `path` with `mask`, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def token_offsets(data: bytes, tokens: list[int]) -> list[int]:
    """Every place the first two of `tokens` (int32 little-endian) occur in `data`: in an LMDB
    file, the live record that holds them and the stale copies in freed pages."""
    pattern = np.asarray(tokens[:2], "<i4").tobytes()
    found, i = [], data.find(pattern)
    while i >= 0:
        found.append(i)
        i = data.find(pattern, i + 1)
    assert found, f"the committed tokens are not in the file: {tokens[:2]}"
    return found


def flip_token_bits(path: str, tokens: list[int]) -> None:
    """Flip a bit in every copy of `tokens`' first two ids in the file at `path` (the log record
    or checkpoint chunk that carries them then fails its checksum; stale copies are damaged too,
    as LMDB copies a page on write)."""
    data = bytearray(Path(path).read_bytes())
    for off in token_offsets(data, tokens):
        data[off + 1] ^= 0x10
    Path(path).write_bytes(data)
