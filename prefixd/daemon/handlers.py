"""The ``PrefixCache`` service's method handlers, registered from the proto's descriptor.

NOTE: instead of the generated ``add_PrefixCacheServicer_to_server``, so that a handler may
answer with an already encoded message (``bytes``): ReadKV frames its KV chunks itself
(``prefixd.api.kv_frames.framed_kv``, one copy of the KV instead of three). Every other reply is
a message, serialized as the generated code would. Requests are decoded by the generated
classes too, except WriteKV's: ``decode_write_request`` leaves the KV bytes in the received
message (a ``KVFrame``) instead of protobuf's two copies of them.
"""

from __future__ import annotations

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.kv_frames import decode_write_request

_SERVICE = pb.DESCRIPTOR.services_by_name["PrefixCache"]
_DECODERS = {"WriteKV": decode_write_request}  # methods whose requests skip protobuf's copies


def _encode(reply) -> bytes:
    return reply if type(reply) is bytes else reply.SerializeToString()


def _handler(method, behaviour):
    request = pb.DESCRIPTOR.message_types_by_name[method.input_type.name]
    decode = _DECODERS.get(method.name) or getattr(pb, request.name).FromString
    if method.client_streaming:
        make = (grpc.stream_stream_rpc_method_handler if method.server_streaming
                else grpc.stream_unary_rpc_method_handler)
    else:
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
    return make(behaviour, request_deserializer=decode, response_serializer=_encode)


def add_service(servicer, server, *, registered: bool = False) -> None:
    """Register every rpc of the service on ``server`` with ``servicer``'s methods, as a
    generic handler only (``registered=True`` registers each method too, as the generated
    code does).

    Raises AttributeError when the servicer lacks one (every rpc must have a handler).

    NOTE: grpc.aio's server waits for its next call with ``asyncio.wait`` over one pending
    future per registered method plus one for generic calls, and re-arms them all on every
    call. With this service's 17 methods, health's 3 and reflection's 1 registered (22
    futures), that wait cost each call ~20 us of the event loop against ~11 with the generic
    future alone. Generic dispatch is one dict lookup in ``method_handlers_generic_handler``.
    """
    handlers = {m.name: _handler(m, getattr(servicer, m.name)) for m in _SERVICE.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    if registered:
        server.add_registered_method_handlers(_SERVICE.full_name, handlers)


class GenericOnly:
    """``server`` as the generated ``add_*Servicer_to_server`` functions see it, taking their
    generic handler and dropping their per-method registration (see ``add_service``)."""

    def __init__(self, server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        self._server.add_generic_rpc_handlers(generic_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        """Nothing: the generic handler serves these methods."""
