"""The transport floor: what one request costs with no model behind it. The same uvicorn (with
the configuration and HTTP protocol `kubetrt serve` runs) and the gRPC server kubetrt serves with read the whole request
(a gRPC request parsed into its message) and answer onnxruntime's outputs for the bench's input,
encoded once at start (bench/serving.py starts it: settings in KUBETRT_BENCH_PEER, the outputs in
the npz it names). A server's one-client p50 minus this floor is what its decoding, batching,
engine and encoding add."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from _onnx import settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _bootstrap  # noqa: E402,F401  kubetrt's gRPC message classes from this checkout

from kubetrt.serving.oip import HEADER_LENGTH as _HEADER_LENGTH  # noqa: E402
from kubetrt.serving.oip_grpc import METHODS, SERVICE  # noqa: E402
from kubetrt.serving.oip_grpc.http2 import GrpcServer  # noqa: E402
from kubetrt.serving.oip_grpc.server import unary  # noqa: E402
from kubetrt.serving.server import serve, uvicorn_config  # noqa: E402

HEADER_LENGTH = _HEADER_LENGTH.encode()  # as ASGI spells header names: lower case


def rest_answers(name: str, outputs: dict[str, np.ndarray]) -> tuple[bytes, bytes, int]:
    """(JSON answer, binary-extension answer, its JSON header's length)."""
    def tensor(k: str, v: np.ndarray, binary: bool) -> dict[str, Any]:
        t: dict[str, Any] = {"name": k, "datatype": "FP32", "shape": list(v.shape)}
        if binary:
            t["parameters"] = {"binary_data_size": v.nbytes}
        else:
            t["data"] = v.ravel().tolist()
        return t
    as_json = json.dumps({"model_name": name, "outputs": [tensor(k, v, False) for k, v in outputs.items()]}).encode()
    header = json.dumps({"model_name": name, "outputs": [tensor(k, v, True) for k, v in outputs.items()]}).encode()
    return as_json, header + b"".join(v.astype("<f4").tobytes() for v in outputs.values()), len(header)


def main() -> None:
    cfg = settings()
    with np.load(cfg["answers"]) as z:
        outputs = {t["name"]: z[t["name"]].astype(np.float32) for t in cfg["outputs"]}
    as_json, as_binary, header_length = rest_answers(cfg["name"], outputs)
    request_cls, response_cls = METHODS["ModelInfer"]
    reply = response_cls(model_name=cfg["name"])
    for k, v in outputs.items():
        reply.outputs.add(name=k, datatype="FP32", shape=list(v.shape))
        reply.raw_output_contents.append(v.astype("<f4").tobytes())
    grpc_server: Any = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal grpc_server
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    grpc_server = await start_grpc(cfg["grpc_port"], request_cls, reply)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await grpc_server.stop(1)
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        binary = any(k == HEADER_LENGTH for k, _ in scope["headers"])
        body, headers = (as_binary, [(HEADER_LENGTH, str(header_length).encode())]) if binary else (as_json, [])
        if scope["method"] == "GET":  # readiness
            body, headers = b"{}", []
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})

    serve(uvicorn_config(app, "127.0.0.1", cfg["http_port"]))


async def start_grpc(port: int, request_cls: Any, reply: Any) -> GrpcServer:
    async def infer(request: Any, remaining: float | None) -> Any:
        return reply

    server = GrpcServer({f"/{SERVICE}/ModelInfer": unary("ModelInfer", infer, request_cls)}, 64 << 20)
    await server.start("127.0.0.1", port)
    return server


if __name__ == "__main__":
    main()
