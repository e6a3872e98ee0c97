"""``PrefixdConnector``: vLLM's ``KVConnectorBase_V1`` over prefixd (imported only by vLLM).

vLLM makes one instance per role: the scheduler's (in the engine core) dispatches to
``SchedulerSide``, the worker's (in each worker process) to ``WorkerSide``. This module only
translates vLLM's objects into theirs; the package docstring has the configuration.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorWorkerMetadata)

from prefixd.api.layout import KVLayout
from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.metadata import SaveReport, StepPlan
from prefixd.client.vllm.options import ConnectorOptions
from prefixd.client.vllm.scheduler import SchedulerSide
from prefixd.client.vllm.shards import Shard, head_range, pool_layers
from prefixd.client.vllm.worker import WorkerSide

log = logging.getLogger(__name__)
PACKAGE_LOGGER = "prefixd.client.vllm"


class PrefixdConnectorMetadata(KVConnectorMetadata):
    """The scheduler's ``StepPlan`` for one step, in vLLM's metadata type."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class PrefixdWorkerMetadata(KVConnectorWorkerMetadata):
    """The worker's ``SaveReport`` for one step, in vLLM's worker-metadata type."""

    def __init__(self, report: SaveReport) -> None:
        self.report = report

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if not isinstance(other, PrefixdWorkerMetadata):
            return self
        return PrefixdWorkerMetadata(self.report.merge(other.report))


class PrefixdConnector(KVConnectorBase_V1):
    """A KV connector whose store is the prefixd daemon on this host (see the package docstring).

    Invariants: exactly one of ``scheduler`` / ``worker`` is set for the role vLLM made it for,
    or neither when the model is one the connector cannot serve (then every request is a miss
    and nothing is copied: the reason is logged once at start).
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        add_log_handler(self.options.log_level)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        try:
            model_kv = prefixd_layout(vllm_config, kv_cache_config, self.options)
        except ValueError as exc:
            log.error("prefixd connector disabled (every request is a miss): %s", exc)
            return
        layout = model_kv.layout
        name = f"vllm-{role.name.lower()}-{os.getpid()}"
        max_model_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
        opts = self.options
        if role == KVConnectorRole.SCHEDULER:
            self._recompute_failed_loads()
            link = DaemonLink(opts.socket, layout, name, mapped=False, timeout_s=opts.timeout_s, retry_s=opts.retry_s,
                              request_timeout_ms=opts.request_timeout_ms, max_model_len=max_model_len)
            link.start()  # attach in the background now, not on the first request
            self.scheduler = SchedulerSide(link, layout.block_size, opts.durability, num_shards=model_kv.num_shards)
            shard = None
        else:
            try:
                shard = worker_shard(vllm_config, model_kv)
            except ValueError as exc:
                log.error("prefixd connector disabled (every request is a miss): %s", exc)
                return
            link = DaemonLink(opts.socket, layout, name, mapped=True, timeout_s=opts.timeout_s, retry_s=opts.retry_s,
                              request_timeout_ms=opts.request_timeout_ms, max_model_len=max_model_len)
            self.worker = WorkerSide(link, model_kv.layer_names, num_kv_heads=model_kv.num_kv_heads,
                                     head_dim=layout.head_dim, block_size=layout.block_size, shard=shard)
        log.info("prefixd connector role=%s socket=%s layout=%s shard=%s durability=%s request_timeout_ms=%g",
                 role.name, opts.socket, layout, shard, opts.durability, opts.request_timeout_ms)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        if self.worker is None:
            return
        if not self.worker.register(kv_caches, attention_backends(self._vllm_config)):
            self.worker = None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        plan = self._plan()
        if self.worker is not None and plan is not None:
            self.worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # wait_for_save saves every layer after the forward (worker.py's NOTE)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self.worker is not None and plan is not None:
            self.worker.save(plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self):
        report = self.worker.take_report() if self.worker is not None else None
        return PrefixdWorkerMetadata(report) if report is not None else None

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, PrefixdConnectorMetadata) else None

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if self.scheduler is None or not prompt:
            return 0, False
        return self.scheduler.num_new_matched_tokens(request.request_id, prompt, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.scheduler is not None and request.prompt_token_ids:
            self.scheduler.after_alloc(request.request_id, request.prompt_token_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self.scheduler is None:
            return PrefixdConnectorMetadata(StepPlan())
        new = [(r.req_id, r.block_ids[0] if r.block_ids else [], r.num_computed_tokens)
               for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        cached = [(req_id, c.new_block_ids[i][0] if c.new_block_ids[i] else None, req_id in c.resumed_req_ids,
                   c.num_computed_tokens[i]) for i, req_id in enumerate(c.req_ids)]
        return PrefixdConnectorMetadata(self.scheduler.build_plan(new, cached, scheduler_output.num_scheduled_tokens))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.scheduler is not None and isinstance(meta, PrefixdWorkerMetadata):
            self.scheduler.on_report(meta.report)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None  # the saves were synchronous: vLLM may free the blocks now

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
            log.info("prefixd connector stats %s link %s", self.scheduler.stats, self.scheduler.link.stats)
        if self.worker is not None:
            self.worker.close()

    def _recompute_failed_loads(self) -> None:
        """A promised block the worker cannot load (the daemon restarted between the open and
        the copy, or the lease was lost) is a load error; vLLM's default policy for those
        ("fail") would fail the request. The scheduler reads the policy after it made the
        connector, so this sets "recompute" (package docstring)."""
        cfg = self._kv_transfer_config
        if getattr(cfg, "kv_load_failure_policy", "recompute") != "recompute":
            try:
                cfg.kv_load_failure_policy = "recompute"
            except (AttributeError, TypeError, ValueError) as exc:  # a frozen config in another vLLM
                log.warning("could not set kv_load_failure_policy=recompute (%s): a daemon restart between "
                            "an open and its load would fail the request; set it in the KVTransferConfig", exc)
                return
            log.info("kv_load_failure_policy set to recompute: a block prefixd cannot give is computed")


class ModelKV(NamedTuple):
    """The pool layout of the whole model and this process's part of it."""

    layout: KVLayout        # the whole model: every layer, every KV head
    layer_names: list       # this process's KV layers, in its order
    pool_layers: tuple      # the pool layer of each of them
    num_kv_heads: int       # the KV heads each rank holds (vLLM's cache spec)
    total_kv_heads: int
    tp_size: int
    pp_size: int

    @property
    def num_shards(self) -> int:
        return self.tp_size * self.pp_size


def prefixd_layout(vllm_config, kv_cache_config, options: ConnectorOptions) -> ModelKV:
    """prefixd's ``KVLayout`` for vLLM's model, and this process's layers in it. The layout is
    the whole model's KV (its total layers and KV heads, whatever the tensor and pipeline
    parallel sizes), so engines of one model at any TP or PP share one pool; the block size is
    vLLM's ``cache_config.block_size`` (the cache spec's), so the two agree by construction.

    Raises:
        ValueError: a KV cache the connector does not serve (the message says why).
    """
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} KV cache groups (a hybrid model: sliding-window or state-space layers "
                         f"beside full attention); the connector serves models with one full-attention group")
    spec = groups[0].kv_cache_spec
    for field in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, field):
            raise ValueError(f"KV cache spec {type(spec).__name__} has no {field} (not attention KV, "
                             f"or layers of different shapes)")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ValueError("K and V of different head sizes")
    model_config = vllm_config.model_config
    total_heads = int(model_config.get_total_num_kv_heads()) if tp > 1 else int(spec.num_kv_heads)
    first, end = head_range(total_heads, tp, 0)
    if end - first != spec.num_kv_heads:
        raise ValueError(f"vLLM's cache holds {spec.num_kv_heads} KV heads per rank, not the {end - first} of "
                         f"{total_heads} heads over tensor parallel size {tp}")
    names = list(groups[0].layer_names)
    total_layers = int(model_config.get_total_num_hidden_layers()) if pp > 1 else len(names)
    layers, num_layers = pool_layers(names, total_layers, pp > 1)
    model_id = options.model_id or str(model_config.model)
    if len(model_id) > 256:
        model_id = hashlib.blake2b(model_id.encode(), digest_size=16).hexdigest()
    dtype = str(spec.dtype).removeprefix("torch.")
    layout = KVLayout(model_id=model_id, num_layers=num_layers, num_kv_heads=total_heads,
                      head_dim=spec.head_size, dtype=dtype, block_size=spec.block_size)
    return ModelKV(layout, names, layers, int(spec.num_kv_heads), total_heads, tp, pp)


def worker_shard(vllm_config, model_kv: ModelKV) -> Shard:
    """This worker's ``Shard``: its TP rank's KV heads and its PP stage's layers (vLLM's
    parallel groups are set up before it makes a worker's connector).

    Raises:
        ValueError: the ranks do not fit the model (the message says how).
    """
    if model_kv.num_shards == 1:
        return Shard(0, 1, model_kv.pool_layers, (0, model_kv.total_kv_heads))
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp_rank = int(get_tensor_model_parallel_rank())
    pp_rank = int(get_pp_group().rank_in_group) if model_kv.pp_size > 1 else 0
    return Shard(pp_rank * model_kv.tp_size + tp_rank, model_kv.num_shards, model_kv.pool_layers,
                 head_range(model_kv.total_kv_heads, model_kv.tp_size, tp_rank))


def attention_backends(vllm_config) -> dict[str, str]:
    """Layer name -> its attention backend's name (how a fused K/V axis splits)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        return {name: layer.attn_backend.get_name()
                for name, layer in get_layers_from_vllm_config(vllm_config, Attention).items()}
    except (ImportError, AttributeError) as exc:
        log.warning("attention backends unknown (%s): taking CPU_ATTN's K/V split", exc)
        return {}


def add_log_handler(level: str) -> None:
    """Give the package's logger a stderr handler at ``level`` when nothing handles it (vLLM
    configures only its own loggers, so the per-request lines would go nowhere)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    if not level or logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
