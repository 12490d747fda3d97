"""gRPC server reflection (grpc.reflection.v1 and v1alpha): what grpcurl, Postman and gRPC UIs ask
first, to list the services and read their protos without a copy of predict_v2.proto. The answers
come from the descriptor pool the server's own messages are built from, so they describe exactly
what the server speaks. Its messages are declared here as the protocol's reflection.proto declares
them (the same field numbers in both versions)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from google.protobuf import descriptor_pb2

from . import _pool, message_class, proto_field
from .grpc_wire import STATUS

VERSIONS = ("grpc.reflection.v1", "grpc.reflection.v1alpha")
SERVICE_NAME = "ServerReflection"
METHOD = "ServerReflectionInfo"
NOT_FOUND, INVALID_ARGUMENT = STATUS["NOT_FOUND"], STATUS["INVALID_ARGUMENT"]  # what an ErrorResponse carries

_S, _B, _I32, _MSG = (descriptor_pb2.FieldDescriptorProto.TYPE_STRING, descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                      descriptor_pb2.FieldDescriptorProto.TYPE_INT32, descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE)
_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED


def _reflection_proto(package: str) -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name=f"{package.replace('.', '/')}/reflection.proto", package=package, syntax="proto3")
    t = f".{package}."
    request = f.message_type.add(name="ServerReflectionRequest")
    request.oneof_decl.add(name="message_request")
    proto_field(request, "host", 1, _S)
    for name, number, kind in (("file_by_filename", 3, _S), ("file_containing_symbol", 4, _S),
                               ("file_containing_extension", 5, _MSG), ("all_extension_numbers_of_type", 6, _S),
                               ("list_services", 7, _S)):
        proto_field(request, name, number, kind, type_name=t + "ExtensionRequest" if kind == _MSG else "", oneof=0)
    extension = f.message_type.add(name="ExtensionRequest")
    proto_field(extension, "containing_type", 1, _S)
    proto_field(extension, "extension_number", 2, _I32)
    response = f.message_type.add(name="ServerReflectionResponse")
    response.oneof_decl.add(name="message_response")
    proto_field(response, "valid_host", 1, _S)
    proto_field(response, "original_request", 2, _MSG, type_name=t + "ServerReflectionRequest")
    for name, number, kind in (("file_descriptor_response", 4, "FileDescriptorResponse"),
                               ("all_extension_numbers_response", 5, "ExtensionNumberResponse"),
                               ("list_services_response", 6, "ListServiceResponse"), ("error_response", 7, "ErrorResponse")):
        proto_field(response, name, number, _MSG, type_name=t + kind, oneof=0)
    proto_field(f.message_type.add(name="FileDescriptorResponse"), "file_descriptor_proto", 1, _B, label=_REPEATED)
    numbers = f.message_type.add(name="ExtensionNumberResponse")
    proto_field(numbers, "base_type_name", 1, _S)
    proto_field(numbers, "extension_number", 2, _I32, label=_REPEATED)
    proto_field(f.message_type.add(name="ListServiceResponse"), "service", 1, _MSG, type_name=t + "ServiceResponse", label=_REPEATED)
    proto_field(f.message_type.add(name="ServiceResponse"), "name", 1, _S)
    error = f.message_type.add(name="ErrorResponse")
    proto_field(error, "error_code", 1, _I32)
    proto_field(error, "error_message", 2, _S)
    f.service.add(name=SERVICE_NAME).method.add(
        name=METHOD, input_type=t + "ServerReflectionRequest", output_type=t + "ServerReflectionResponse",
        client_streaming=True, server_streaming=True)
    return f


for _package in VERSIONS:
    _pool.Add(_reflection_proto(_package))


def file_closure(name: str) -> list[bytes]:
    """The serialized FileDescriptorProto of file `name` and of every file it imports, itself first."""
    seen: dict[str, bytes] = {}
    todo = [_pool.FindFileByName(name)]
    while todo:
        f = todo.pop()
        if f.name not in seen:
            seen[f.name] = f.serialized_pb
            todo.extend(f.dependencies)
    return list(seen.values())


def file_of_symbol(symbol: str) -> str:
    """The file that declares a fully qualified message, enum, service or method; KeyError where none does."""
    try:
        return str(_pool.FindFileContainingSymbol(symbol).name)
    except KeyError:
        service, _, method = symbol.rpartition(".")
        found = _pool.FindServiceByName(service) if service else None  # KeyError where it is no service either
        if found is None or method not in found.methods_by_name:
            raise KeyError(symbol) from None
        return str(found.file.name)


def answer(request: Any, services: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """A ServerReflectionRequest's answer -> (its ServerReflectionResponse field, that field's value as keywords)."""
    kind = request.WhichOneof("message_request")
    try:
        if kind == "list_services":
            return "list_services_response", {"service": [{"name": s} for s in services]}
        if kind == "file_by_filename":
            return "file_descriptor_response", {"file_descriptor_proto": file_closure(request.file_by_filename)}
        if kind == "file_containing_symbol":
            return "file_descriptor_response", {"file_descriptor_proto": file_closure(file_of_symbol(request.file_containing_symbol))}
        if kind == "all_extension_numbers_of_type":
            name = request.all_extension_numbers_of_type
            _pool.FindMessageTypeByName(name)  # KeyError where there is no such message
            return "all_extension_numbers_response", {"base_type_name": name, "extension_number": []}
        if kind == "file_containing_extension":
            ext = request.file_containing_extension
            return "error_response", {"error_code": NOT_FOUND, "error_message":
                                      f"no extension {ext.extension_number} of {ext.containing_type}: this server's protos declare no extensions"}
    except KeyError as e:
        return "error_response", {"error_code": NOT_FOUND, "error_message": f"not found: {e.args[0] if e.args else e}"}
    return "error_response", {"error_code": INVALID_ARGUMENT, "error_message":
                              "the request asks nothing: expected one of list_services, file_by_filename, "
                              "file_containing_symbol, file_containing_extension, all_extension_numbers_of_type"}


class ReflectionService:
    """ServerReflectionInfo of one version of the protocol: each request message answered in turn."""

    def __init__(self, package: str, services: Sequence[str]) -> None:
        self.services = list(services)
        self.Request = message_class("ServerReflectionRequest", package)
        self.Response = message_class("ServerReflectionResponse", package)

    async def ServerReflectionInfo(self, requests: AsyncIterator[Any], remaining: float | None) -> AsyncIterator[Any]:
        async for request in requests:
            field, value = answer(request, self.services)
            yield self.Response(valid_host=request.host, original_request=request, **{field: value})
