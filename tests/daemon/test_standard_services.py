"""The standard services beside ``PrefixCache`` on a real daemon's socket: health checking
(``grpc.health.v1``) and server reflection, both served through generic handlers only
(``handlers.GenericOnly``), and what an unknown method gets."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon.handlers import GenericOnly, add_service
from tests.daemon.harness import start_daemon

SERVICE = "prefixd.v1.PrefixCache"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


@pytest.fixture(scope="module")
def daemon():
    with start_daemon() as d:
        yield d


@pytest.mark.parametrize("service", ["", SERVICE])
def test_health_check_says_serving(daemon, service):
    stub = health_pb2_grpc.HealthStub(daemon.channel())
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_check_of_an_unknown_service_is_not_found(daemon):
    stub = health_pb2_grpc.HealthStub(daemon.channel())
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_streams_the_current_status(daemon):
    stub = health_pb2_grpc.HealthStub(daemon.channel())
    stream = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    try:
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stream.cancel()


def test_reflection_lists_the_services_and_describes_every_rpc(daemon):
    db = ProtoReflectionDescriptorDatabase(daemon.channel())
    assert set(db.get_services()) == {SERVICE, HEALTH, REFLECTION}
    pool = descriptor_pool.DescriptorPool(db)
    served = pool.FindServiceByName(SERVICE)
    ours = pb.DESCRIPTOR.services_by_name["PrefixCache"]
    assert [m.name for m in served.methods] == [m.name for m in ours.methods]
    assert served.methods_by_name["Open"].input_type.full_name == "prefixd.v1.OpenRequest"


def test_an_unknown_method_is_unimplemented_and_the_daemon_serves_on(daemon):
    ch = daemon.channel()
    call = ch.unary_unary(f"/{SERVICE}/NoSuchRpc", request_serializer=bytes,
                          response_deserializer=bytes)
    with pytest.raises(grpc.RpcError) as err:
        call(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    reply = daemon.stub().Status(pb.StatusRequest(), timeout=5)
    assert reply.state == "serving"


class _Recorder:
    """What a server was asked to register."""

    def __init__(self) -> None:
        self.generic: list = []
        self.registered: list[str] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, name, handlers) -> None:
        self.registered.append(name)


class _Servicer:
    def __getattr__(self, name):
        async def behaviour(request, context):
            return None
        return behaviour


@pytest.mark.parametrize("registered", [False, True])
def test_add_service_registers_methods_only_when_asked(registered):
    server = _Recorder()
    add_service(_Servicer(), server, registered=registered)
    assert len(server.generic) == 1
    assert server.registered == ([SERVICE] if registered else [])


def test_generic_only_passes_the_generic_handler_and_drops_the_registration():
    server = _Recorder()
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), GenericOnly(server))
    assert len(server.generic) == 1 and server.registered == []
