"""What ``Attach`` tells a client so that it can map the daemon's DEVICE and HOST pools instead of
moving KV through the rpcs (DESIGN.md "The API"; the client side is ``prefixd.client.mapped``)."""

from __future__ import annotations

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import cuda_ipc_handle
from prefixd.api.tiers import TIER_NAMES, Tier


def pool_descriptors(pool) -> list[pb.PoolDescriptor]:
    """How a client maps the DEVICE and HOST pools of ``pool`` (a ``DurableCache``), for the
    ``Attach`` reply: an shm file's path, offset, shape, strides (elements), dtype and file id;
    or, for a CUDA device pool (no file), torch's CUDA IPC handle of the pool tensor and its
    device (``prefixd.api.tensors.tensor_from_cuda_ipc`` maps it in another process)."""
    store = pool.store
    out = []
    for tier in (Tier.DEVICE, Tier.HOST):
        if tier not in store.tiers:
            continue
        d = store.descriptor(tier)
        msg = pb.PoolDescriptor(tier=TIER_NAMES[tier], shape=d["shape"], strides=d["strides"],
                                dtype=d["dtype"])
        if d["path"] is None:
            tensor = store.pool(tier).tensor
            msg.cuda_ipc = cuda_ipc_handle(tensor)
            msg.cuda_device = tensor.device.index or 0
        else:
            msg.path, msg.offset, msg.file_id = d["path"], d["offset"], d["file_id"]
        out.append(msg)
    return out
