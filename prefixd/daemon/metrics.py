"""The daemon's numbers, in one place: what the Prometheus endpoint and the ``Stats`` rpc serve.

``snapshot(core)`` reads the engine and the daemon (on the event loop's thread: it walks
structures the engine does not lock) and returns a list of ``Family``: a metric's name (the
``prefixd_`` prefix, no ``_total``), kind, help and samples. Both outlets render that list:

- ``prefixd.daemon.metrics_http`` serves it to Prometheus, every label kept (``tenant`` and
  ``model`` name the pool);
- ``stats_values`` makes the ``Stats`` rpc's map for one tenant: samples of other tenants are
  left out, the ``tenant`` and ``model`` labels are dropped and what they split is summed, and
  keys are spelled as in the exposition (``prefixd_hit_tokens_total``,
  ``prefixd_blocks{tier="device",state="indexed"}``, ``prefixd_rpc_seconds_bucket{...,le="0.001"}``).

NOTE: one builder, two renderings, so a number cannot drift between the scrape and the rpc.
The rpc sums a tenant's pools because a client asks about its own tenant and has no use for
the pool split; a Prometheus query sums the same way with ``sum without (model)``.

``RpcTimes`` is the rpc latency histogram the ``rpc_call.rpc`` decorator feeds (method, status).
"""

from __future__ import annotations

import bisect
import json
import os
import time
from typing import NamedTuple

from prefixd.daemon import collector
from prefixd.daemon.heap import heap_stats
from prefixd.daemon.kv_wire import MEDIUMS
from prefixd.wal.group import COMMIT_S_BOUNDS, GROUP_SIZE_BOUNDS

TIERS = ("device", "host", "disk")
RPC_S_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 10.0)
STATES = ("recovering", "serving", "stopping")


class Histogram(NamedTuple):
    """One histogram sample: counts per bucket (not cumulative; the last one is above
    ``bounds[-1]``), the sum of the observations."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float


class Family(NamedTuple):
    """One metric: ``kind`` is counter, gauge or histogram; each sample is (labels, value),
    the value a number or, for a histogram, a ``Histogram``."""

    name: str
    kind: str
    help: str
    samples: list


class RpcTimes:
    """Latency of the unary rpcs by (method, status), in ``RPC_S_BOUNDS`` buckets.

    Written by ``rpc_call.rpc`` on the loop (``observe``: two dict lookups by interned strings,
    a bisect, two adds); ``snapshot`` copies it on the loop.
    Invariants: ``_by_status[status][method]`` is ``len(RPC_S_BOUNDS) + 1`` bucket counts
    followed by the sum of the observations.
    """

    __slots__ = ("_by_status",)

    _SUM = len(RPC_S_BOUNDS) + 1

    def __init__(self) -> None:
        self._by_status: dict[str, dict[str, list]] = {}

    def observe(self, method: str, status: str, seconds: float) -> None:
        try:
            counts = self._by_status[status][method]
        except KeyError:
            counts = self._by_status.setdefault(status, {}).setdefault(
                method, [0] * (self._SUM + 1))
        counts[bisect.bisect_left(RPC_S_BOUNDS, seconds)] += 1
        counts[self._SUM] += seconds

    def samples(self) -> list:
        n = self._SUM
        return [({"method": m, "status": s}, Histogram(RPC_S_BOUNDS, tuple(c[:n]), c[n]))
                for s, by_method in sorted(self._by_status.items())
                for m, c in sorted(by_method.items())]

    def check_invariants(self) -> None:
        for by_method in self._by_status.values():
            for counts in by_method.values():
                assert len(counts) == self._SUM + 1 and counts[self._SUM] >= 0


def snapshot(core) -> list[Family]:
    """Every family, read now (on the loop's thread)."""
    fams: dict[str, Family] = {}

    def add(name: str, kind: str, help_: str, labels: dict, value) -> None:
        fam = fams.get(name)
        if fam is None:
            fam = fams[name] = Family(name, kind, help_, [])
        fam.samples.append((labels, value))

    add("prefixd_up", "gauge", "1 while the daemon answers", {}, 1)
    for state in STATES:
        add("prefixd_state", "gauge", "the daemon's state (1 for the current one)",
            {"state": state}, int(core.state == state))
    add("prefixd_uptime_seconds", "gauge", "seconds since the daemon started", {},
        time.monotonic() - core.started)
    replayed, total = core.progress.as_tuple()
    add("prefixd_recovery_records_replayed", "gauge", "log records replayed by the last recovery",
        {}, replayed)
    add("prefixd_recovery_records", "gauge", "log records the last recovery had to replay", {},
        total)
    heap = heap_stats()
    if heap is not None:  # glibc: RSS less the free bytes is what the daemon's data holds
        add("prefixd_heap_in_use_bytes", "gauge", "bytes of malloc's heap in use (glibc mallinfo2)",
            {}, heap.in_use_bytes)
        add("prefixd_heap_free_bytes", "gauge", "bytes free inside malloc's heap, kept rather than "
            "returned to the OS (prefixd.daemon.heap)", {}, heap.free_bytes)
    add("prefixd_gc_frozen_objects", "gauge", "objects alive when serving began, which the "
        "collector no longer walks (prefixd.daemon.collector)", {}, collector.frozen())
    for generation, n in enumerate(collector.collections()):
        add("prefixd_gc_collections", "counter", "cyclic garbage collections by generation (2: "
            "full)", {"generation": str(generation)}, n)
    if core.engine is not None:
        for (tenant, layout), dc in core.engine.pool_items():
            _pool(add, {"tenant": tenant, "model": layout.model_id}, dc, layout.block_size)
        for (tenant, layout), st in core.engine.closer.closed_stats.items():  # counters never go down
            _pool_counters(add, {"tenant": tenant, "model": layout.model_id}, st,
                           layout.block_size)
        _budgets(add, core.engine.budgets.snapshot())
    by_tenant: dict[str, int] = {t.name: 0 for t in core.engine_config.tenants}
    for session in core.sessions:
        by_tenant[session.tenant] = by_tenant.get(session.tenant, 0) + 1
    for tenant, n in by_tenant.items():
        add("prefixd_sessions", "gauge", "attached client sessions", {"tenant": tenant}, n)
    _events(add, core)
    _kv_events(add, core)
    for method, n in sorted(core.calls.items()):
        add("prefixd_rpc_calls", "counter", "rpcs received", {"method": method}, n)
    for method, n in sorted(core.errors.items()):
        add("prefixd_rpc_errors", "counter", "rpcs answered with an error status",
            {"method": method}, n)
    add("prefixd_rpc_in_flight", "gauge", "rpcs being served", {}, core.in_flight)
    _loop_lag(add, core)
    for labels, hist in core.rpc_times.samples():
        add("prefixd_rpc_seconds", "histogram", "unary rpc latency by method and status",
            labels, hist)
    return list(fams.values())


def _loop_lag(add, core) -> None:
    """How late the event loop runs its callbacks (``prefixd.daemon.loop_lag``)."""
    lag = getattr(core, "loop_lag", None)
    if lag is None:
        return
    p99, worst = lag.recent()
    add("prefixd_loop_lag_p99_seconds", "gauge", "99th percentile of the event loop's lag over "
        "the last 10 s (how late a 5 ms timer fires)", {}, p99)
    add("prefixd_loop_lag_max_seconds", "gauge", "largest event loop lag over the last 10 s", {},
        worst)
    add("prefixd_loop_lag_seconds", "histogram", "event loop lag: how late a 5 ms timer fires "
        "(every call waits as long)", {}, lag.histogram())


def _budgets(add, snap: dict) -> None:
    """The byte budgets' families (``prefixd.engine.budgets``): per tier, and per tenant."""
    for tier in TIERS:
        add("prefixd_budget_bytes", "gauge", "the tier's byte budget ([engine.budget])",
            {"tier": tier}, snap[tier]["budget"])
        for tenant, n in sorted(snap[tier]["by_tenant"].items()):
            add("prefixd_used_bytes", "gauge", "bytes the tier's pool files take, by tenant",
                {"tier": tier, "tenant": tenant}, n)
    add("prefixd_log_reserve_bytes", "gauge", "disk bytes of the budget kept for the logs", {},
        snap["log_reserve"])
    add("prefixd_filesystem_full", "gauge", "1 while a pool file meets a full filesystem "
        "(commits go on through the host tier; grows are retried)", {}, int(snap["out_of_space"]))


def _events(add, core) -> None:
    """The KV-event journals' families, per tenant (``prefixd.daemon.event_journal``)."""
    events = getattr(core, "events", None)
    if events is None:
        return
    for tenant, j in events.items():
        labels = {"tenant": tenant}
        add("prefixd_events_emitted", "counter", "KV events numbered for routers (blocks stored "
            "/ removed per tier)", labels, j.emitted)
        add("prefixd_event_subscribers", "gauge", "SubscribeEvents streams open", labels,
            j.num_subscribers)
        add("prefixd_event_overflows", "counter", "event subscribers cut off for falling too far "
            "behind (RESOURCE_EXHAUSTED)", labels, j.overflows)
        add("prefixd_event_gaps", "counter", "event streams begun with a cleared event (asked "
            "for more than the ring holds, or another daemon start)", labels, j.gaps)
        add("prefixd_event_ring_events", "gauge", "events held for a replay-from", labels,
            j.next_sequence_number - j.oldest)


def _kv_events(add, core) -> None:
    """The ZMQ publishers' families, per tenant (``prefixd.daemon.kv_publisher``)."""
    pubs = getattr(core, "kv_publishers", None)
    if pubs is None:
        return
    add("prefixd_kv_events_loop_seconds", "counter", "the event loop's time spent noting and "
        "publishing KV events on ZMQ (their cost to every request)", {}, pubs.busy_ns / 1e9)
    for tenant, p in pubs.items():
        labels = {"tenant": tenant}
        add("prefixd_kv_events_batches", "counter", "KVEventBatch messages published on ZMQ",
            labels, p.batches)
        add("prefixd_kv_events_pending", "gauge", "logged batches of cache events noted for "
            "the next KVEventBatch (sent within FLUSH_S, 20 ms)", labels, len(p.pending))
        add("prefixd_kv_events_dropped_batches", "counter", "batches a subscriber's full queue "
            "could not take (sent to none; kept for replay)", labels, p.dropped)
        add("prefixd_kv_events_replayed_batches", "counter", "batches sent again on replay "
            "requests", labels, pubs.replays.replayed.get(tenant, 0))
        for tier, medium in enumerate(MEDIUMS):
            m = {"tenant": tenant, "medium": medium}
            add("prefixd_kv_events_stored_blocks", "counter", "blocks published as BlockStored",
                m, p.stored[tier])
            add("prefixd_kv_events_removed_blocks", "counter", "blocks published as "
                "BlockRemoved", m, p.removed[tier])


def _pool_counters(add, pool: dict, st, block_size: int) -> None:
    """The counter families of one pool's ``CacheStats`` (an open pool's or a closed one's)."""
    counters = (
        ("prefixd_requested_tokens", "tokens asked for by opens", st.requested_tokens),
        ("prefixd_hit_tokens", "tokens of opens found cached", st.hit_tokens),
        ("prefixd_requested_blocks", "full blocks asked for by opens", st.requested_blocks),
        ("prefixd_hit_blocks", "blocks of opens found cached", st.hit_tokens // block_size),
        ("prefixd_opens", "sequences opened", st.opens),
        ("prefixd_committed_blocks", "blocks indexed by commits", st.committed_blocks),
        ("prefixd_cow_blocks", "blocks copied on write (a fork's shared tail extended)",
         st.cow_blocks),
        ("prefixd_corrupt_blocks", "disk blocks that failed their checksum", st.corrupt_blocks),
    )
    for name, help_, value in counters:
        add(name, "counter", help_, pool, value)
    host, disk = st.hit_tokens_by_tier[1:]
    for tier, n in zip(TIERS, (st.hit_tokens - host - disk, host, disk)):
        add("prefixd_hit_tokens_by_tier", "counter", "hit tokens by the tier they were found in",
            pool | {"tier": tier}, n)


def _pool(add, pool: dict, dc, block_size: int) -> None:
    """The families of one pool (``pool``: its tenant and model labels)."""
    cache = dc.cache
    st = cache.stats
    _pool_counters(add, pool, st, block_size)
    add("prefixd_hit_rate", "gauge", "hit tokens / requested tokens since the start", pool,
        st.hit_rate)
    add("prefixd_cow_blocks_per_token", "gauge", "blocks copied on write per requested token "
        "since the start", pool, st.cow_blocks / st.requested_tokens if st.requested_tokens else 0.0)
    tree = cache.tree
    for t, tier in enumerate(TIERS):
        alloc = cache.allocators[t]
        if alloc is None:
            continue
        labels = pool | {"tier": tier}
        indexed = tree.num_blocks_in[t]
        quarantined = alloc.num_deferred
        for state, n in (("indexed", indexed), ("private", max(alloc.num_used - indexed, 0)),
                         ("quarantined", quarantined)):
            add("prefixd_blocks", "gauge", "blocks by tier and state (indexed: in the cache; "
                "private: a sequence's own, not indexed yet; quarantined: freed, reusable once "
                "the log is durable)", labels | {"state": state}, n)
        add("prefixd_capacity_blocks", "gauge", "pool size in blocks", labels, alloc.num_slots)
        add("prefixd_free_blocks", "gauge", "free blocks", labels, alloc.num_free)
        add("prefixd_grow_refusals", "counter", "grows of the tier's pool file refused: its "
            "budget was full, or the filesystem was (ENOSPC, EDQUOT)", labels,
            dc.store.grow_refusals(t))
        refusals, full = dc.store.no_space(t)
        add("prefixd_no_space_refusals", "counter", "grows of the tier's pool file the "
            "filesystem refused (ENOSPC, EDQUOT)", labels, refusals)
        add("prefixd_out_of_space", "gauge", "1 while the tier's pool file cannot grow for a "
            "full filesystem", labels, int(full))
        for name, help_, values in (
                ("prefixd_evicted_blocks", "blocks evicted from a tier", st.evicted_by_tier),
                ("prefixd_demoted_blocks", "blocks copied down before their eviction, by the "
                 "tier they left", st.demoted_by_tier),
                ("prefixd_promoted_blocks", "blocks copied to the device on a hit, by the tier "
                 "they came from", st.promoted_by_tier)):
            add(name, "counter", help_, labels, values[t])
    add("prefixd_pinned_device_blocks", "gauge", "device blocks held by live sequences' locks",
        pool, tree.pinned_device_blocks())
    sequences = list(cache.sequences())
    add("prefixd_sequences", "gauge", "live sequences", pool, len(sequences))
    add("prefixd_refcount", "gauge", "block references held by live sequences (the sum of "
        "their block tables)", pool, sum(len(s.block_table) for s in sequences))
    wal = dc.wal.stats()
    add("prefixd_wal_records", "counter", "log records committed", pool, wal.records_committed)
    add("prefixd_wal_syncs", "counter", "log fsyncs", pool, wal.syncs)
    add("prefixd_wal_checkpoints", "counter", "checkpoints written", pool, wal.checkpoints)
    if wal.commit_s_buckets:
        add("prefixd_wal_commit_seconds", "histogram", "time to commit one log group (fsync "
            "included)", pool, Histogram(COMMIT_S_BOUNDS, wal.commit_s_buckets, wal.total_commit_s))
        add("prefixd_wal_group_records", "histogram", "records per committed log group", pool,
            Histogram(GROUP_SIZE_BOUNDS, wal.group_size_buckets,
                      float(wal.records_committed)))
    recovery = getattr(dc, "recovery", None) or {}
    add("prefixd_recovery_seconds", "gauge", "how long this pool's last recovery took", pool,
        float(recovery.get("ready_s", 0.0)))
    cluster = getattr(dc, "cluster", None)
    if cluster is not None:  # [engine.cluster]: remote hits, fetch errors, write-behind
        for name, value in cluster.stats().items():
            add(f"prefixd_cluster_{name}", "counter", f"cluster tier: {name} (see "
                "prefixd.engine.cluster_tier.ClusterTier.stats)", pool, value)


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def stats_values(families: list[Family], tenant: str) -> dict[str, float]:
    """The ``Stats`` rpc's map for ``tenant``: other tenants' samples left out, the ``tenant``
    and ``model`` labels dropped (their samples summed), keys spelled as in the exposition."""
    out: dict[str, float] = {}

    def put(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + float(value)

    for fam in families:
        for labels, value in fam.samples:
            if labels.get("tenant", tenant) != tenant:
                continue  # one tenant never counts another's blocks
            rest = {k: v for k, v in labels.items() if k not in ("tenant", "model")}
            if fam.kind == "counter":
                put(f"{fam.name}_total{_labels(rest)}", value)
            elif fam.kind == "gauge":
                if fam.name in ("prefixd_hit_rate", "prefixd_cow_blocks_per_token"):
                    continue  # a ratio does not sum over pools: computed below
                put(f"{fam.name}{_labels(rest)}", value)
            else:
                cumulative = 0
                for bound, n in zip((*value.bounds, float("inf")), value.counts):
                    cumulative += n
                    put(f"{fam.name}_bucket{_labels(rest | {'le': _le(bound)})}", cumulative)
                put(f"{fam.name}_count{_labels(rest)}", cumulative)
                put(f"{fam.name}_sum{_labels(rest)}", value.total)
    requested = out.get("prefixd_requested_tokens_total", 0.0)
    if requested:
        out["prefixd_hit_rate"] = out.get("prefixd_hit_tokens_total", 0.0) / requested
        out["prefixd_cow_blocks_per_token"] = out.get("prefixd_cow_blocks_total", 0.0) / requested
    return out


def stats_document(core, tenant: str) -> dict:
    """The ``Stats`` rpc's JSON document: the tenant's pools' cache counters and blocks, keyed
    by model id (``pool_key``: two layouts of one model id get keys that tell them apart)."""
    pools = {}
    if core.engine is not None:
        items = [(layout, dc) for (pool_tenant, layout), dc in core.engine.pool_items()
                 if pool_tenant == tenant]
        # a closed pool (empty, no session) keeps its counters, with no block
        items += [(layout, st) for (pool_tenant, layout), st in core.engine.closer.closed_stats.items()
                  if pool_tenant == tenant]
        shared = {layout.model_id for layout, _ in items}
        shared = {m for m in shared if sum(1 for layout, _ in items if layout.model_id == m) > 1}
        for layout, dc in items:
            closed = not hasattr(dc, "cache")
            entry = pools[pool_key(layout, layout.model_id in shared)] = {
                "cache": (dc if closed else dc.cache.stats).as_dict(),
                "blocks": [0, 0, 0] if closed else list(dc.cache.tree.num_blocks_in),
                "layout": {"model_id": layout.model_id, "num_layers": layout.num_layers,
                           "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                           "dtype": layout.dtype, "block_size": layout.block_size},
                "closed": closed}
            if getattr(dc, "cluster", None) is not None:
                entry["cluster"] = dc.cluster.stats()
    sessions = sum(1 for s in core.sessions if s.tenant == tenant)
    return {"tenant": tenant, "pools": pools, "sessions": float(sessions), "pid": os.getpid()}


def pool_key(layout, shared: bool) -> str:
    """A pool's key in the Stats document: its model id, or, when another pool of the tenant
    has the same model id (a vLLM at block 128 beside a client at 16), the model id with the
    layout: ``m [L=30 H=3 D=64 float32 block=128]``.

    NOTE: keyed by model id alone, the second pool overwrote the first in the document."""
    if not shared:
        return layout.model_id
    return (f"{layout.model_id} [L={layout.num_layers} H={layout.num_kv_heads} D={layout.head_dim} "
            f"{layout.dtype} block={layout.block_size}]")


def stats_reply_parts(core, tenant: str) -> tuple[dict[str, float], str]:
    """``(values, json)`` of the ``Stats`` rpc for ``tenant`` (on the loop's thread)."""
    values = stats_values(snapshot(core), tenant)
    return values, json.dumps(stats_document(core, tenant), sort_keys=True)
