"""FastAPI app: thin routes over the protocol codecs (oip, tfserving) and the model registry.

Routes take the raw Request and return raw Responses: the codecs do their own validation with
messages that name the tensor, and pydantic models on the hot path would only add cost.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import kubetrt
from kubetrt.telemetry.logs import log

from . import json_numbers, oip, tfserving
from .calls import lookup, tracked
from .infer_route import InferRoute, read_body
from .errors import BadRequest, ServingError, Unavailable, error_response
from .metrics import CONTENT_TYPE, ServingMetrics
from .registry import ModelLike, ModelRegistry, ModelSource, ServingConfig
from .shared_memory import SharedMemoryRegions, regions_or_refuse

logger = logging.getLogger("kubetrt.serving")

JSON = "application/json"


class ServingApp(FastAPI):
    """FastAPI, with the OIP infer route answered before any of FastAPI's own layers (error,
    telemetry and body-limit middlewares, the router): InferRoute does its own errors and limits,
    and those layers cost as much as decoding a small tensor. Every other request is FastAPI's."""

    infer_route: InferRoute | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.infer_route is not None:
            await self.infer_route(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(
    packages: Iterable[str | os.PathLike[str] | ModelSource] = (),
    config: ServingConfig | None = None,
    *,
    models: Iterable[ModelLike] = (),
) -> ServingApp:
    """App serving the given model packages (loaded in the background) and/or loaded models."""
    config = config or ServingConfig()
    metrics = ServingMetrics()
    registry = ModelRegistry(config, metrics)
    for p in packages:
        registry.add_source(p if isinstance(p, ModelSource) else ModelSource.local(p))
    for m in models:
        registry.add_model(m)
    regions = SharedMemoryRegions() if config.shared_memory else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if config.grpc_port is not None:
            from .oip_grpc.server import create_grpc_server  # the gRPC protocol loads only where it serves

            grpc_server = create_grpc_server(registry, config, regions)
            app.state.grpc_port = await grpc_server.start(config.grpc_host, config.grpc_port)
            log(logger, logging.INFO, "gRPC endpoint up", address=f"{config.grpc_host}:{app.state.grpc_port}")
        # Load after startup so liveness answers while models load; readiness waits for them.
        loading = asyncio.create_task(_load_and_freeze(registry))
        try:
            yield
        finally:
            if grpc_server is not None:  # HTTP has drained; in-flight gRPC calls finish before batchers close
                await grpc_server.stop(config.graceful_timeout_s)
            if not loading.done():
                loading.cancel()
            await asyncio.to_thread(registry.close)
            if regions is not None:
                regions.unregister()

    app = ServingApp(title="kubetrt serving", version=kubetrt.__version__, lifespan=lifespan)
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.config = config
    app.state.grpc_port = None
    _install_error_handlers(app)
    _add_oip_routes(app, registry, config, regions)
    _add_shared_memory_routes(app, regions, config)
    _add_tfserving_routes(app, registry, config)
    app.infer_route = InferRoute(functools.partial(FastAPI.__call__, app), registry, config, regions)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _load_and_freeze(registry: ModelRegistry) -> None:
    """Compile the JSON number scanner and load the models, then move everything alive into the
    collector's permanent generation: a full collection walked every object of the loaded runtime
    (50-120 ms, each one a latency spike for every request in flight); after the freeze it walks
    only what requests allocate."""
    await asyncio.to_thread(json_numbers.warm_up)
    await registry.load_all()
    gc.collect()
    gc.freeze()


def _json(doc: Any, status: int = 200) -> Response:
    return Response(json.dumps(doc, separators=(",", ":")), status_code=status, media_type=JSON)


async def read_request_body(request: Request, limit: int) -> bytes:
    return await read_body(request.receive, request.headers.get("content-length"), limit)


def _add_oip_routes(app: FastAPI, registry: ModelRegistry, config: ServingConfig,
                    regions: SharedMemoryRegions | None) -> None:
    extensions = ["binary_tensor_data", *(["system_shared_memory"] if regions is not None else [])]

    @app.get("/v2")
    async def server_metadata() -> Response:
        return _json({"name": "kubetrt", "version": kubetrt.__version__, "extensions": extensions})

    @app.get("/v2/health/live")
    async def live() -> Response:
        return _json({"live": True})

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        if registry.ready:
            return _json({"ready": True})
        reasons = registry.not_ready_reasons() or ["no models are configured"]
        raise Unavailable("not ready: " + "; ".join(reasons))

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None) -> Response:
        s = registry.get(name, version)
        return _json({
            "name": s.name,
            "versions": [s.version],
            "platform": "kubetrt",
            "inputs": oip.tensor_metadata(s.inputs),
            "outputs": oip.tensor_metadata(s.outputs),
            "ready": s.ready,
            "state": s.state.value,
            "reason": s.reason,
            "device": s.device,
        })

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> Response:
        s = registry.get(name, version)
        if not s.ready:
            raise Unavailable(f"model {s.name} version {s.version} is not ready: {s.reason}")
        return _json({"name": s.name, "ready": True})

    # POST /v2/models/{name}[/versions/{version}]/infer: serving/infer_route.py, ahead of the app


def _add_shared_memory_routes(app: FastAPI, regions: SharedMemoryRegions | None, config: ServingConfig) -> None:
    """Triton's system shared memory extension (shared_memory.py), as tritonclient.http calls it."""
    @app.get("/v2/systemsharedmemory/status")
    @app.post("/v2/systemsharedmemory/status")
    @app.get("/v2/systemsharedmemory/region/{name}/status")
    @app.post("/v2/systemsharedmemory/region/{name}/status")
    async def status(name: str | None = None) -> Response:
        return _json([r.status() for r in regions_or_refuse(regions, "shared memory status").status(name)])

    @app.post("/v2/systemsharedmemory/region/{name}/register")
    async def register(request: Request, name: str) -> Response:
        found = regions_or_refuse(regions, f"registering region {name!r}")
        body = await read_request_body(request, config.max_body_bytes)
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise BadRequest(f"registering region {name!r}: malformed JSON ({e})") from None
        if not isinstance(doc, dict):
            raise BadRequest(f"registering region {name!r}: expected an object with key, offset and byte_size")
        found.register(name, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
        return _json({})

    @app.post("/v2/systemsharedmemory/unregister")
    @app.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def unregister(name: str | None = None) -> Response:
        regions_or_refuse(regions, "unregistering shared memory").unregister(name)
        return _json({})


def _add_tfserving_routes(app: FastAPI, registry: ModelRegistry, config: ServingConfig) -> None:
    @app.get("/v1/models/{name}")
    @app.get("/v1/models/{name}/versions/{version}")
    async def tf_status(name: str, version: str | None = None) -> Response:
        s = registry.get(name, version)
        state = {"ready": "AVAILABLE", "loading": "LOADING"}.get(s.state.value, "END")
        return _json(tfserving.model_status(s.version, state, "" if s.ready or state == "LOADING" else s.reason))

    @app.get("/v1/models/{name}/metadata")
    @app.get("/v1/models/{name}/versions/{version}/metadata")
    async def tf_metadata(name: str, version: str | None = None) -> Response:
        s = registry.get(name, version)
        return _json(tfserving.model_metadata(s.name, s.version, s.signature, s.inputs, s.outputs))

    async def tf_predict(request: Request) -> Response:
        p = request.path_params
        served = lookup(registry, p["name"], p.get("version"))

        async def handle() -> Response:
            body = await read_request_body(request, config.max_body_bytes)
            feeds, columnar = tfserving.decode_predict(body, served.inputs, served.signature or tfserving.DEFAULT_SIGNATURE)
            results = await served.infer(feeds)
            return Response(tfserving.encode_predict(results, served.outputs, columnar), media_type=JSON)

        return await tracked(served, handle)

    app.add_route("/v1/models/{name}:predict", tf_predict, methods=["POST"])
    app.add_route("/v1/models/{name}/versions/{version}:predict", tf_predict, methods=["POST"])


def _install_error_handlers(app: FastAPI) -> None:
    async def serving_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServingError)
        if exc.status == 500:  # a runtime fault on a valid request; 4xx/503/504 are the client's news
            log(logger, logging.WARNING, "inference failed", path=request.url.path, error=exc.message)
        return error_response(exc.status, exc.message, exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        message = {404: f"no route for {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, getattr(exc, "headers", None))

    async def validation_error(request: Request, exc: Exception) -> Response:
        return error_response(400, f"invalid request: {exc}")

    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(ServingError, serving_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
