"""The standard gRPC health service (grpc.health.v1.Health/Check): what Kubernetes' gRPC probes and
grpc_health_probe ask. The empty service name (or the OIP service's) is the server's readiness, a
model's name that model's; any other name is NOT_FOUND, as the protocol asks. Its messages and Check
are declared here as the protocol's health.proto declares them, in the pool of the OIP messages
(server reflection describes it from there)."""
from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2

from ..registry import ModelRegistry
from . import SERVICE as OIP_SERVICE
from . import _pool, message_class, proto_field

SERVICE = "grpc.health.v1.Health"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = range(4)


def _health_proto() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="grpc/health/v1/health.proto", package="grpc.health.v1", syntax="proto3")
    proto_field(f.message_type.add(name="HealthCheckRequest"), "service", 1, descriptor_pb2.FieldDescriptorProto.TYPE_STRING)
    response = f.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    proto_field(response, "status", 1, descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
                type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    f.service.add(name="Health").method.add(name="Check", input_type=".grpc.health.v1.HealthCheckRequest",
                                            output_type=".grpc.health.v1.HealthCheckResponse")
    return f


_pool.Add(_health_proto())
HealthCheckRequest = message_class("HealthCheckRequest", "grpc.health.v1")
HealthCheckResponse = message_class("HealthCheckResponse", "grpc.health.v1")


def serving_status(registry: ModelRegistry, service: str) -> int:
    """SERVING or NOT_SERVING for a service name; a name that is no model raises NotFound."""
    if service in ("", OIP_SERVICE):
        return SERVING if registry.ready else NOT_SERVING
    return SERVING if registry.get(service).ready else NOT_SERVING


class HealthService:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def Check(self, request: Any, remaining: float | None) -> Any:
        return HealthCheckResponse(status=serving_status(self.registry, request.service))
