"""The OIP gRPC endpoint: thin handlers over the registry, batcher and metrics the REST routes use,
served by http2.py on the REST routes' event loop, with each serving error answered by its gRPC
status code (errors.py)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from google.protobuf.message import DecodeError

import kubetrt
from kubetrt.telemetry.logs import log

from ..calls import lookup, tracked
from ..errors import ServingError
from ..registry import ModelRegistry, ServingConfig, timeout_from_params
from ..shared_memory import SharedMemoryRegions, regions_or_refuse
from . import (
    METHODS, SERVICE, STREAM_METHODS, ModelInferRequest, ModelReadyResponse, ModelStreamInferResponse, ServerLiveResponse,
    ServerMetadataResponse, ServerReadyResponse, SystemSharedMemoryRegisterResponse, SystemSharedMemoryStatusResponse,
    SystemSharedMemoryUnregisterResponse, codec, health, reflection,
)
from .grpc_wire import RpcError
from .http2 import GrpcServer, Streaming, Unary

logger = logging.getLogger("kubetrt.serving")
Handler = Callable[[Any, "float | None"], Awaitable[Any]]


class InferenceService:
    """One method per rpc of inference.GRPCInferenceService: (request, seconds left before the
    client's deadline or None) -> response."""

    def __init__(self, registry: ModelRegistry, regions: SharedMemoryRegions | None = None) -> None:
        self.registry = registry
        self.regions = regions

    async def ServerLive(self, request: Any, remaining: float | None) -> Any:
        return ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, remaining: float | None) -> Any:
        return ServerReadyResponse(ready=self.registry.ready)

    async def ModelReady(self, request: Any, remaining: float | None) -> Any:
        return ModelReadyResponse(ready=self.registry.get(request.name, request.version or None).ready)

    async def ServerMetadata(self, request: Any, remaining: float | None) -> Any:
        return ServerMetadataResponse(name="kubetrt", version=kubetrt.__version__)

    async def ModelMetadata(self, request: Any, remaining: float | None) -> Any:
        s = self.registry.get(request.name, request.version or None)
        return codec.model_metadata(s.name, s.version, s.inputs, s.outputs)

    async def ModelInfer(self, request: codec.InferMessage, remaining: float | None) -> Any:
        served = lookup(self.registry, request.msg.model_name, request.msg.model_version or None)

        async def handle() -> Any:
            req = codec.decode_infer_request(request, served.inputs, served.outputs, self.regions)
            timeout = timeout_from_params(req.parameters)
            if remaining is not None:  # the client's deadline, where it set one
                timeout = remaining if timeout is None else min(timeout, remaining)
            results = await served.infer(req.feeds, timeout)
            return codec.encode_infer_response(served.name, served.version, req, results, self.regions)

        return await tracked(served, handle)

    async def SystemSharedMemoryStatus(self, request: Any, remaining: float | None) -> Any:
        response = SystemSharedMemoryStatusResponse()
        for region in regions_or_refuse(self.regions, "shared memory status").status(request.name):
            response.regions[region.name].CopyFrom(SystemSharedMemoryStatusResponse.RegionStatus(**region.status()))
        return response

    async def SystemSharedMemoryRegister(self, request: Any, remaining: float | None) -> Any:
        regions_or_refuse(self.regions, f"registering region {request.name!r}").register(
            request.name, request.key, request.offset, request.byte_size)
        return SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, remaining: float | None) -> Any:
        regions_or_refuse(self.regions, "unregistering shared memory").unregister(request.name)
        return SystemSharedMemoryUnregisterResponse()

    async def ModelStreamInfer(self, requests: AsyncIterator[codec.InferMessage], remaining: float | None) -> AsyncIterator[Any]:
        """Triton's stream of inferences: every request starts as it arrives (so those that arrive
        while the model is busy are batched, as separate calls would be) and is answered in turn; one
        that fails is answered with its error and the stream goes on."""
        started: asyncio.Queue[asyncio.Future[Any] | None] = asyncio.Queue()

        async def start_each() -> None:
            try:
                async for request in requests:
                    started.put_nowait(asyncio.ensure_future(self._stream_answer(request)))
            finally:
                started.put_nowait(None)

        reader = asyncio.ensure_future(start_each())
        try:
            while (answer := await started.get()) is not None:
                yield await answer
            await reader  # a message that was no request fails the stream here, after the answers before it
        finally:
            reader.cancel()
            while not started.empty():
                left = started.get_nowait()
                if left is not None:
                    left.cancel()

    async def _stream_answer(self, request: codec.InferMessage) -> Any:
        try:
            return ModelStreamInferResponse(infer_response=await self.ModelInfer(request, None))
        except ServingError as e:
            if e.status == 500:
                log(logger, logging.WARNING, "inference failed", rpc="ModelStreamInfer", error=e.message)
            return ModelStreamInferResponse(error_message=e.message)


def _reader(request_cls: Any, parse: Callable[[memoryview], Any] | None = None) -> Callable[[memoryview], Any]:
    read = request_cls.FromString if parse is None else parse

    def read_message(message: memoryview) -> Any:
        try:
            return read(message)
        except DecodeError as e:
            raise RpcError("INTERNAL", f"the request is not a {request_cls.DESCRIPTOR.full_name} message: {e}") from None
    return read_message


def unary(name: str, method: Handler, request_cls: Any, parse: Callable[[memoryview], Any] | None = None) -> Unary:
    """A service method as http2.py calls it: message bytes in (read by `parse`, request_cls.FromString
    where None), message bytes out, serving errors raised as their gRPC status."""
    read = _reader(request_cls, parse)

    async def call(message: memoryview, remaining: float | None) -> bytes:
        request = read(message)
        try:
            response = await method(request, remaining)
        except ServingError as e:
            if e.status == 500:
                log(logger, logging.WARNING, "inference failed", rpc=name, error=e.message)
            raise RpcError(e.grpc_code, e.message) from None
        return response.SerializeToString()
    return call


def streaming(method: Callable[[AsyncIterator[Any], "float | None"], AsyncIterator[Any]], request_cls: Any,
              parse: Callable[[memoryview], Any] | None = None) -> Streaming:
    """A streaming method as http2.py calls it: each message read (by `parse`, request_cls.FromString
    where None), each answer written."""
    read = _reader(request_cls, parse)

    async def call(messages: AsyncIterator[memoryview], remaining: float | None) -> AsyncIterator[bytes]:
        async def requests() -> AsyncIterator[Any]:
            async for message in messages:
                yield read(message)

        async for response in method(requests(), remaining):
            yield response.SerializeToString()
    return call


def create_grpc_server(registry: ModelRegistry, config: ServingConfig,
                       regions: SharedMemoryRegions | None = None) -> GrpcServer:
    """An unstarted server of the OIP service's methods, the health service's Check and server
    reflection; `await server.start(host, port)` listens."""
    service = InferenceService(registry, regions)
    parsers = {ModelInferRequest: codec.read_infer_request}  # its raw contents kept as views of the message
    methods = {f"/{SERVICE}/{name}": unary(name, getattr(service, name), request_cls, parsers.get(request_cls))
               for name, (request_cls, _) in METHODS.items()}
    methods[f"/{health.SERVICE}/Check"] = unary("Check", health.HealthService(registry).Check, health.HealthCheckRequest)
    reflected = [f"{package}.{reflection.SERVICE_NAME}" for package in reflection.VERSIONS]
    streams: dict[str, Streaming] = {
        f"/{SERVICE}/{name}": streaming(getattr(service, name), request_cls, parsers.get(request_cls))
        for name, (request_cls, _) in STREAM_METHODS.items()}
    for package, name in zip(reflection.VERSIONS, reflected):
        answers = reflection.ReflectionService(package, [SERVICE, health.SERVICE, *reflected])
        streams[f"/{name}/{reflection.METHOD}"] = streaming(answers.ServerReflectionInfo, answers.Request)
    return GrpcServer(methods, config.max_body_bytes, streams)
