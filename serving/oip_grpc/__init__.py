"""The Open Inference Protocol's gRPC messages, from predict_v2.proto compiled by protoc into a
descriptor set (predict_v2.binpb), loaded into a descriptor pool of kubetrt's own.

Why not protoc's generated _pb2 modules: they register the protocol's names ('inference.*') in
protobuf's default pool, as tritonclient's, KServe's and MLServer's copies of the same protocol
do, and two registrations in one process fail at import. A pool of our own never meets theirs;
the wire format, which is all a client sees, is the same.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "inference.GRPCInferenceService"
DESCRIPTOR_SET = Path(__file__).with_name("predict_v2.binpb")

_pool = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes()).file:
    _pool.Add(_file)


def proto_field(message: descriptor_pb2.DescriptorProto, name: str, number: int, kind: int, *, type_name: str = "",
                label: int = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, oneof: int | None = None) -> None:
    """Declare a field of a message built in code (the protocols whose protos are not compiled here)."""
    field = message.field.add(name=name, number=number, type=kind, label=label, json_name=name)
    if type_name:
        field.type_name = type_name
    if oneof is not None:
        field.oneof_index = oneof


def message_class(name: str, package: str = "inference") -> Any:
    """The message class of `<package>.<name>` (nested ones as 'Outer.Inner')."""
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{package}.{name}"))


ServerLiveResponse = message_class("ServerLiveResponse")
ServerReadyResponse = message_class("ServerReadyResponse")
ModelReadyResponse = message_class("ModelReadyResponse")
ServerMetadataResponse = message_class("ServerMetadataResponse")
ModelMetadataResponse = message_class("ModelMetadataResponse")
ModelInferRequest = message_class("ModelInferRequest")
ModelInferResponse = message_class("ModelInferResponse")

ModelStreamInferResponse = message_class("ModelStreamInferResponse")
SystemSharedMemoryStatusResponse = message_class("SystemSharedMemoryStatusResponse")
SystemSharedMemoryRegisterResponse = message_class("SystemSharedMemoryRegisterResponse")
SystemSharedMemoryUnregisterResponse = message_class("SystemSharedMemoryUnregisterResponse")


def _methods(streaming: bool) -> dict[str, tuple[Any, Any]]:
    return {m.name: (message_class(m.input_type.name), message_class(m.output_type.name))
            for m in _pool.FindServiceByName(SERVICE).methods if m.client_streaming == streaming}


# rpc name -> (request class, response class), as the service declares them: the unary ones, and
# the streaming one (Triton's ModelStreamInfer)
METHODS = _methods(streaming=False)
STREAM_METHODS = _methods(streaming=True)
