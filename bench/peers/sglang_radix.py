"""SGLang's ``RadixCache`` driven with the same requests as ``bench/core.py``, in the same process.

Per request, what SGLang's scheduler does around its radix cache, timed the way
``prefixd.tools.driver.replay`` times prefixd:

- ``open``: ``match_prefix`` of the prompt, ``inc_lock_ref`` on the matched node, then the
  KV-slot allocation for the uncached rest (evicting from the tree when the pool is short);
- ``extend``: allocation for the output tokens (decode);
- ``commit``: ``insert`` of prompt + output with their slot indices, freeing the pages the
  tree already held (SGLang's ``cache_finished_req``);
- ``release``: ``dec_lock_ref`` and freeing the partial last page.

The token-slot allocator is a page free list (what ``PagedTokenToKVPoolAllocator`` keeps), so the
time is the tree's and the index tensors' it moves, as in SGLang. Install with
``make bench-peers``; ``load()`` returns ``None`` when SGLang is not there.
"""

from __future__ import annotations

import importlib.machinery
import os
import pathlib
import sys
import time
import types
from array import array

import numpy as np
import torch

DEFAULT_PATH = pathlib.Path(__file__).resolve().parent.parent / "out" / "sglang"


class _AbsentModule(types.ModuleType):
    """Stands in for torchvision, which RadixCache's import chain names (a VLM config) but
    never calls: the published torchvision wheels are built against another torch."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is not installed for this benchmark")


def _absent(name: str) -> _AbsentModule:
    module = sys.modules.get(name)
    if module is None:
        module = _AbsentModule(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        sys.modules[name] = module
    return module


def load(path: str | os.PathLike | None = None):
    """The ``radix_cache`` module of an installed SGLang, or ``None``."""
    path = pathlib.Path(path or os.environ.get("PREFIXD_SGLANG_PATH") or DEFAULT_PATH)
    if not (path / "sglang").is_dir():
        return None
    sys.path.insert(0, str(path))
    import transformers.utils.import_utils as hf_imports

    if not hf_imports.is_torchvision_available():  # decided before the stand-in exists
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                     "torchvision.io"):
            _absent(name)
    from sglang.srt.mem_cache import radix_cache

    return radix_cache


class PagePool:
    """Token slots handed out in whole pages (``page_size`` consecutive slots)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(num_pages - 1, 0, -1))  # page 0 reserved, as in SGLang
        self.device = "cpu"

    def available(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        need = -(-num_tokens // self.page_size)
        if need > len(self.free_pages):
            return None
        pages = [self.free_pages.pop() for _ in range(need)]
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        slots = (base[:, None] + torch.arange(self.page_size)).reshape(-1)
        return slots[:num_tokens]

    def free_segment(self, value: torch.Tensor, start_pos: int = 0) -> None:
        self.free(value[start_pos:])

    def free(self, value: torch.Tensor) -> None:
        if len(value):
            self.free_pages.extend(torch.unique(value // self.page_size).tolist())


def replay(rc, reqs, num_blocks: int, block_size: int) -> tuple[dict[str, list[int]], float]:
    """Run ``reqs`` through a fresh ``RadixCache``; returns ns per op and the token hit rate."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

    pool = PagePool(num_blocks, block_size)
    tree = rc.RadixCache.create_simulated(mock_allocator=pool, page_size=block_size)
    times: dict[str, list[int]] = {"open": [], "extend": [], "commit": [], "release": []}
    clock = time.perf_counter_ns
    requested = hit = 0
    for req in reqs:
        prompt = array("q", np.frombuffer(req.prompt, dtype="<i4").astype(np.int64).tobytes())
        output = array("q", np.frombuffer(req.output, dtype="<i4").astype(np.int64).tobytes())
        t0 = clock()
        match = tree.match_prefix(MatchPrefixParams(key=rc.RadixKey(prompt[:-1])))
        node = match.last_device_node
        cached = match.device_prefix_len
        tree.inc_lock_ref(node)
        prefix = tree.path_device_indices(node) if cached else torch.empty(0, dtype=torch.int64)
        new = _alloc(tree, pool, len(prompt) - cached, EvictParams)
        t1 = clock()
        more = _alloc(tree, pool, len(output) - 1, EvictParams)
        t2 = clock()
        tokens = prompt + output[:-1]
        value = torch.cat([prefix, new, more])
        aligned = len(tokens) // block_size * block_size
        result = tree.insert(InsertParams(key=rc.RadixKey(tokens[:aligned]), value=value[:aligned]))
        pool.free(value[cached:result.prefix_len])  # pages the tree already held: duplicates
        t3 = clock()
        tree.dec_lock_ref(node)
        pool.free(value[aligned:])
        t4 = clock()
        times["open"].append(t1 - t0)
        times["extend"].append(t2 - t1)
        times["commit"].append(t3 - t2)
        times["release"].append(t4 - t3)
        requested += len(prompt)
        hit += cached
    return times, hit / requested


def _alloc(tree, pool: PagePool, num_tokens: int, EvictParams) -> torch.Tensor:
    slots = pool.alloc(num_tokens)
    if slots is None:
        tree.evict(EvictParams(num_tokens=num_tokens - pool.available() + pool.page_size))
        slots = pool.alloc(num_tokens)
        if slots is None:
            raise RuntimeError("sglang peer: pool too small for one request")
    return slots
