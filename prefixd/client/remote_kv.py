"""The KV path over the socket, for clients that cannot map the pools: WriteKV, ReadKV, Attend.

``WriteKV`` is client-streamed: the token range goes in chunks of whole blocks (when a block
fits) that each stay under the daemon's message limit. ``ReadKV`` is server-streamed: the
daemon chunks, the client places each chunk at its ``start`` in one output tensor.
"""

from __future__ import annotations

import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from prefixd.api.kv_frames import KVFrame, decode_read_reply, framed_kv
from prefixd.api.tensors import dtype_name, from_tensor_msg, tensor_from_bytes, to_tensor_msg
from prefixd.client.errors import DataLoss, InvalidArgument
from prefixd.kernels.token_io import copy_into

HEADROOM_BYTES = 4096  # the message's fields other than the KV bytes
_WRITE_CHUNK = pb.WriteKVRequest.DESCRIPTOR.fields_by_name["chunk"].number


class KVStub(pb_grpc.PrefixCacheStub):
    """The generated stub, but the KV bytes skip protobuf (``prefixd.api.kv_frames``):
    ``WriteKV`` sends requests encoded by ``write_kv`` itself (``framed_kv``: one copy of the
    KV instead of three), and ``ReadKV`` answers ``KVFrame``s whose KV bytes are still the
    received message's (``decode_read_reply``: none of protobuf's two copies)."""

    def __init__(self, channel) -> None:
        super().__init__(channel)
        self.WriteKV = channel.stream_unary("/prefixd.v1.PrefixCache/WriteKV",
                                            request_serializer=None,
                                            response_deserializer=pb.WriteKVReply.FromString)
        self.ReadKV = channel.unary_stream("/prefixd.v1.PrefixCache/ReadKV",
                                           request_serializer=pb.ReadKVRequest.SerializeToString,
                                           response_deserializer=decode_read_reply)



def chunk_tokens(token_bytes: int, block_size: int, max_message_bytes: int) -> int:
    """Tokens per WriteKV chunk: as many whole blocks as fit under the limit (at least one token)."""
    fit = max(1, (max_message_bytes - HEADROOM_BYTES) // max(1, token_bytes))
    return fit - fit % block_size if fit >= block_size else fit


def write_kv(stub, session_id: int, seq_id: int, start: int, kv: torch.Tensor, block_size: int,
             max_message_bytes: int, timeout: float | None) -> int:
    """Stream ``kv`` (``[num_layers, 2, n, num_kv_heads, head_dim]``) as tokens ``start ..``;
    returns the tokens the daemon wrote."""
    n = kv.shape[2]
    token_bytes = kv[:, :, :1].numel() * kv.element_size()
    step = chunk_tokens(token_bytes, block_size, max_message_bytes)
    dtype_name(kv.dtype)  # ValueError for a dtype the API does not carry, before any send
    kv = kv.detach().cpu()
    outer = pb.WriteKVRequest(session_id=session_id).SerializeToString()

    def chunks():
        # The first chunk ends on a block boundary so later chunks cover whole blocks.
        a = start
        end = start + n
        first = min(end, a + step - (a % block_size if step >= block_size else 0))
        bounds = [a, first] if first > a else [a]
        while bounds[-1] < end:
            bounds.append(min(end, bounds[-1] + step))
        for lo, hi in zip(bounds, bounds[1:]):
            # encoded here, the KV copied once (KVStub sends bytes as they are)
            yield framed_kv(outer, _WRITE_CHUNK, seq_id, lo, kv[:, :, lo - start:hi - start])

    reply = stub.WriteKV(chunks(), timeout=timeout)
    return reply.written_tokens


def read_kv(stub, session_id: int, seq_id: int, start: int, n: int, layout,
            timeout: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The KV of tokens ``start .. start + n``, assembled from the daemon's chunks into ``out``
    (or a new CPU tensor). ``stub.ReadKV`` answers ``KVFrame``s (``KVStub``) or, from a
    generated stub, ``ReadKVReply`` messages.

    Raises:
        DataLoss: the stream covered another range than the one asked for.
    """
    if out is None:
        out = torch.empty((layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim),
                          dtype=layout.torch_dtype())
    got = 0
    request = pb.ReadKVRequest(session_id=session_id, seq_id=seq_id, start=start, num_tokens=n)
    for reply in stub.ReadKV(request, timeout=timeout):
        frame = KVFrame.of(reply)
        c = frame.message.chunk
        lo = c.start - start
        if lo < 0 or lo + c.num_tokens > n or list(c.shape)[2:3] != [c.num_tokens]:
            raise DataLoss(f"ReadKV answered tokens {c.start}..{c.start + c.num_tokens} (shape "
                           f"{list(c.shape)}) for a read of {start}..{start + n}")
        try:
            piece = tensor_from_bytes(frame.data, c.shape, c.dtype)
        except ValueError as exc:
            raise DataLoss(f"ReadKV answered a malformed chunk: {exc}") from None
        copy_into(out[:, :, lo:lo + c.num_tokens], piece)  # in this thread (token_io's NOTE)
        got += c.num_tokens
    if got != n:
        raise DataLoss(f"ReadKV answered {got} of the {n} tokens asked for ({start}..{start + n})")
    return out


def attend(stub, session_id: int, seq_ids: list[int], query: torch.Tensor, *, layer: int,
           new_k, new_v, query_start_loc, scale: float | None, timeout: float | None) -> torch.Tensor:
    """Paged attention computed by the daemon over its pool; returns a CPU tensor like ``query``."""
    try:
        request = pb.AttendRequest(session_id=session_id, seq_ids=seq_ids, layer=layer,
                                   query=to_tensor_msg(query), scale=scale or 0.0)
        if new_k is not None:
            request.new_k.CopyFrom(to_tensor_msg(new_k))
            request.new_v.CopyFrom(to_tensor_msg(new_v))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if query_start_loc is not None:
        request.query_start_loc.extend(int(x) for x in query_start_loc)
    reply = stub.Attend(request, timeout=timeout)
    try:
        return from_tensor_msg(reply.output).clone()
    except ValueError as exc:
        raise DataLoss(f"Attend answered a malformed output: {exc}") from None
