"""The daemon's own rpcs on a tenant's socket: Stats, SubscribeEvents, Status, Checkpoint.

``AdminRpcs`` is the part of ``PrefixCacheService`` (``prefixd.daemon.service``) that asks
about or acts on the daemon as a whole rather than on a session's sequences or KV.

NOTE: a part the servicer holds, not a servicer of its own: gRPC registers one servicer per
service (``handlers.add_service``), so ``PrefixCacheService`` keeps a handler for each of these
rpcs that awaits this part's.
"""

from __future__ import annotations

import logging
import os
import time

import prefixd
from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon.core import RECOVERING
from prefixd.daemon.event_stream import subscribe_events
from prefixd.daemon.metrics import stats_reply_parts
from prefixd.daemon.rpc_call import rpc

log = logging.getLogger(__name__)


class AdminRpcs:
    """The daemon rpcs of one tenant's ``PrefixCacheService`` (see the module's NOTE).

    Args:
        core: the ``DaemonCore``.
        tenant: the socket's tenant (Status and Stats report its pools and sessions only).
        session: ``session(session_id)``: the caller's session of ``tenant``, checked and
            pinged (the servicer's ``_session``; raises for a session not found).

    Holds no state beyond these.
    """

    def __init__(self, core, tenant: str, session) -> None:
        self.core = core
        self.tenant = tenant
        self._session = session

    @rpc
    async def Stats(self, request, context):
        if request.session_id:
            self._session(request.session_id)
        values, doc = stats_reply_parts(self.core, self.tenant)  # the metrics endpoint's numbers
        return pb.StatsReply(values=values, json=doc)

    async def SubscribeEvents(self, request, context):
        async for event in subscribe_events(self.core, self.tenant, request, context):
            yield event

    @rpc
    async def Status(self, request, context):
        core = self.core
        reply = pb.StatusReply(state=core.state, pid=os.getpid(), version=prefixd.__version__,
                               uptime_s=time.monotonic() - core.started, tenant=self.tenant,
                               sessions=sum(1 for s in core.sessions if s.tenant == self.tenant))
        reply.records_replayed, reply.records_total = core.progress.as_tuple()
        if core.state != RECOVERING and core.engine is not None:
            for info in core.engine.pools():
                if info.tenant == self.tenant:
                    lay = info.layout
                    reply.pools.add(tenant=info.tenant, model_id=lay.model_id,
                                    blocks=list(info.num_blocks), capacity=list(info.capacity),
                                    layout=pb.KVLayout(model_id=lay.model_id,
                                                       num_layers=lay.num_layers,
                                                       num_kv_heads=lay.num_kv_heads,
                                                       head_dim=lay.head_dim, dtype=lay.dtype,
                                                       block_size=lay.block_size))
            snap = core.engine.budgets.snapshot()
            for tier in ("device", "host", "disk"):
                t = snap[tier]
                reply.budgets.add(tier=tier, budget_bytes=t["budget"], used_bytes=t["used"],
                                  tenant_used_bytes=t["by_tenant"].get(self.tenant, 0),
                                  log_reserve_bytes=snap["log_reserve"] if tier == "disk" else 0)
        return reply

    @rpc
    async def Checkpoint(self, request, context):
        # beside the loop (``offloop``): other calls are served meanwhile
        lsns = await self.core.offloop.checkpoint_all(self.core.engine)
        log.info("checkpoint on request pools=%d", len(lsns))
        return pb.CheckpointReply(pools=len(lsns))
