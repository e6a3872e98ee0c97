"""The worker side of the connector: copies blocks between vLLM's paged KV tensors and
prefixd's mapped pool as the scheduler side planned them (pure Python + torch; no vLLM import).

- ``register``: finds each layer's layout from the tensor vLLM registers (``paged_layout``) and
  keeps a block-order view of it, in prefixd's layer order; attaches (mapping the pool).
- ``load`` (vLLM's ``start_load_kv``, before the forward): the plan's loads; blocks it cannot
  load (no mapping, another daemon epoch, lease lost) become load errors for vLLM.
- ``save`` (vLLM's ``wait_for_save``, after the forward): the plan's saves, reported per
  request and shard to the scheduler side (``take_report``), which commits only what every
  shard saved.

Under tensor or pipeline parallelism each worker process has its own ``WorkerSide`` and
session, and copies only its ``Shard`` of each block (its KV heads, its layers) between its
tensors and the whole-model pool, in place; every worker gets the same plan.

NOTE: the copies are synchronous, all layers at once: on a CPU backend the forward and the
copy share the same cores, so overlapping a layer's copy with the next layer's compute buys
nothing, and a save done before ``wait_for_save`` returns never races vLLM freeing the blocks.
NOTE: a mapped copy cannot see a daemon restart, and a restarted daemon may give the slots of
an uncommitted sequence to another client. So the worker copies only while its own session is
attached to the daemon epoch the slots were handed out in and its keep-alive stream is up,
checked before and after each batch of copies (the stream breaks the moment the daemon dies).
"""

from __future__ import annotations

import logging

from prefixd.client.vllm.block_transfer import load_blocks, save_blocks
from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.metadata import SaveReport, StepPlan
from prefixd.client.vllm.paged_layout import LayoutError, find_layout, split_for_backend
from prefixd.client.vllm.shards import Shard

log = logging.getLogger(__name__)


class WorkerSide:
    """What the worker half of ``PrefixdConnector`` does, over one mapped ``DaemonLink``.

    State: ``views`` (one block-order view per prefixd layer, None until ``register`` found
    every layer's layout); ``_errors`` (vLLM block ids that failed to load, until taken);
    ``_report`` (this step's saves, until taken).

    Invariants: ``views`` is None or has one view per layer of the worker (``layer_names``,
    the pool layers ``shard.layers``), each of shape ``[num_blocks, 2, block_size,
    shard.num_kv_heads, head_dim]``.
    """

    def __init__(self, link: DaemonLink, layer_names, *, num_kv_heads: int, head_dim: int,
                 block_size: int, shard: Shard | None = None) -> None:
        self.link = link
        self.layer_names = list(layer_names)
        self.shard = shard or Shard.whole(len(self.layer_names), num_kv_heads)
        if len(self.shard.layers) != len(self.layer_names) or self.shard.num_kv_heads != num_kv_heads:
            raise ValueError(f"{self.shard} does not hold {len(self.layer_names)} layers of {num_kv_heads} KV heads")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.views: list | None = None
        self.layouts: dict[str, object] = {}
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self._errors: set[int] = set()
        self._report = SaveReport()

    def register(self, kv_caches: dict, backend_names: dict | None = None) -> bool:
        """Find the layout of every layer's tensor; True when the connector can copy.

        Args:
            kv_caches: layer name -> the tensor vLLM registered.
            backend_names: layer name -> its attention backend's name (how a fused K/V axis
                splits, ``split_for_backend``); a layer not named is taken as ``CPU_ATTN``.
        """
        backend_names = backend_names or {}
        views = []
        try:
            for name in self.layer_names:
                if name not in kv_caches:
                    raise LayoutError(f"vLLM registered no KV tensor for layer {name}")
                tensor = kv_caches[name]
                layout = find_layout(tensor.shape, tensor.stride(), num_kv_heads=self.num_kv_heads,
                                     head_dim=self.head_dim, block_size=self.block_size,
                                     fused_split=split_for_backend(backend_names.get(name, "CPU_ATTN")))
                self.layouts[name] = layout
                views.append(layout.view(tensor))
        except LayoutError as exc:
            log.error("prefixd connector disabled (every request is a miss): %s", exc)
            return False
        self.views = views
        first = self.layouts[self.layer_names[0]]
        log.info("vLLM KV layout form=%s shape=%s strides=%s layers=%d", first.form,
                 tuple(kv_caches[self.layer_names[0]].shape), first.strides, len(views))
        # attach and map the pool now (vLLM's start, not a step), waiting up to the Attach deadline
        self.link.start(self.link.timeout_s)
        return True

    def load(self, plan: StepPlan) -> None:
        """The plan's loads into vLLM's blocks (before the forward)."""
        self._errors |= plan.failed_block_ids
        if not plan.loads:
            return
        ids = [b for t in plan.loads for b in t.block_ids]
        pool = self._pool(plan.epoch)
        if pool is None:
            self._errors.update(ids)
            return
        for t in plan.loads:
            load_blocks(pool, self.views, t.block_ids, t.slots, self.shard)
        if not self._held(plan.epoch):  # the daemon died under the copy: the slots may be reused
            self._errors.update(ids)
            return
        self.loaded_blocks += len(ids)

    def save(self, plan: StepPlan) -> None:
        """The plan's saves into prefixd's slots (after the forward), reported per request."""
        if not plan.saves:
            return
        pool = self._pool(plan.epoch)
        if pool is not None:
            for t in plan.saves:
                save_blocks(pool, self.views, t.block_ids, t.slots, self.shard)
        if pool is None or not self._held(plan.epoch):
            self._report.failed.update(t.req_id for t in plan.saves)
            return
        for t in plan.saves:
            self._report.add(t.req_id, self.shard.index, len(t.block_ids))
            self.saved_blocks += len(t.block_ids)

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> SaveReport | None:
        """This step's saves (None when there were none)."""
        report, self._report = self._report, SaveReport()
        return report if (report.saved or report.failed) else None

    def close(self) -> None:
        self.link.close()

    def _pool(self, epoch: int):
        """The mapped pool tensor, if copies through slots of ``epoch`` are safe now."""
        if self.views is None:
            return None
        def pool_if_safe(s):
            if not s.lease_held:
                s.stats()  # a call, so that the library recovers the session (or raises Unavailable)
            return s.pool.tensor if s.pool is not None and s.epoch == epoch and s.lease_held else None

        return self.link.call("map", pool_if_safe)

    def _held(self, epoch: int) -> bool:
        return bool(self.link.call("lease", lambda s: s.epoch == epoch and s.lease_held, False))

    def check_invariants(self) -> None:
        if self.views is not None:
            assert len(self.views) == len(self.layer_names)
            for v in self.views:
                assert tuple(v.shape[1:]) == (2, self.block_size, self.num_kv_heads, self.head_dim), v.shape
        self.link.check_invariants()
