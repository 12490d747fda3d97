"""NVIDIA Triton (tritonserver as the nvidia-pytriton 0.7.0 wheel carries it) serving model.onnx:
Triton's C++ HTTP/gRPC front ends and dynamic batcher, the model a Python callable running
onnxruntime at its defaults (bench/serving.py starts it: settings in KUBETRT_BENCH_PEER). Its system
shared memory API is open, as kubetrt serve's is with --shared-memory: pytriton guards it with a token
by default, beside the other endpoints it still guards."""
from __future__ import annotations

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig

from _onnx import Session, settings


def main() -> None:
    cfg = settings()
    session = Session(cfg)

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return session.run(inputs)

    onnx_outputs = session.session.get_outputs()
    config = TritonConfig(http_address="127.0.0.1", http_port=cfg["http_port"], grpc_address="127.0.0.1",
                          grpc_port=cfg["grpc_port"], metrics_port=cfg["metrics_port"])
    guarded = [e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "shared-memory"]
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=guarded)) as triton:
        triton.bind(
            model_name=cfg["name"],
            infer_func=infer,
            inputs=[Tensor(name=t["name"], dtype=np.float32, shape=tuple(t["shape"][1:])) for t in cfg["inputs"]],
            outputs=[Tensor(name=t["name"], dtype=np.float32,
                            shape=tuple(d if isinstance(d, int) else -1 for d in o.shape[1:]))
                     for t, o in zip(cfg["outputs"], onnx_outputs)],
            config=ModelConfig(max_batch_size=cfg["max_batch_size"],
                               batcher=DynamicBatcher(max_queue_delay_microseconds=cfg["max_queue_delay_us"])),
            strict=False,
        )
        triton.serve()


if __name__ == "__main__":
    main()
