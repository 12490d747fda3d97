"""The OIP gRPC endpoint (grpc.aio): thin handlers over the registry, batcher and metrics the REST
routes use, with each serving error answered by its gRPC status code (errors.py)."""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import grpc

import kubetrt
from kubetrt.telemetry.logs import log

from ..calls import lookup, tracked
from ..errors import ServingError
from ..registry import ModelRegistry, ServingConfig, timeout_from_params
from . import (
    METHODS, SERVICE, ModelReadyResponse, ServerLiveResponse, ServerMetadataResponse, ServerReadyResponse, codec,
)

logger = logging.getLogger("kubetrt.serving")
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class InferenceService:
    """One method per rpc of inference.GRPCInferenceService."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return ServerReadyResponse(ready=self.registry.ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return ModelReadyResponse(ready=self.registry.get(request.name, request.version or None).ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return ServerMetadataResponse(name="kubetrt", version=kubetrt.__version__)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        s = self.registry.get(request.name, request.version or None)
        return codec.model_metadata(s.name, s.version, s.inputs, s.outputs)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        served = lookup(self.registry, request.model_name, request.model_version or None)

        async def handle() -> Any:
            req = codec.decode_infer_request(request, served.inputs, served.outputs)
            timeout = timeout_from_params(req.parameters)
            remaining = context.time_remaining()  # the client's deadline, where it set one
            if remaining is not None:
                timeout = remaining if timeout is None else min(timeout, remaining)
            results = await served.infer(req.feeds, timeout)
            return codec.encode_infer_response(served.name, served.version, req, results)

        return await tracked(served, handle)


def _answering_errors(method: Handler) -> Handler:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(request, context)
        except ServingError as e:
            if e.status == 500:
                log(logger, logging.WARNING, "inference failed", rpc=method.__name__, error=e.message)
            await context.abort(grpc.StatusCode[e.grpc_code], e.message)
    call.__name__ = method.__name__
    return call


def create_grpc_server(registry: ModelRegistry, config: ServingConfig, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """An unstarted server bound to host:port (0: any free port) -> (server, bound port). A busy
    port fails here: gRPC's SO_REUSEPORT, on by default, would let two servers share it."""
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", config.max_body_bytes),
        ("grpc.max_send_message_length", -1),
    ])
    service = InferenceService(registry)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _answering_errors(getattr(service, name)),
            request_deserializer=request_cls.FromString,
            response_serializer=response_cls.SerializeToString,
        )
        for name, (request_cls, response_cls) in METHODS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port} (in use?)")
    return server, bound
