"""KServe 0.21 ModelServer serving model.onnx through a kserve.Model running onnxruntime at its
defaults (bench/serving.py starts it: settings in KUBETRT_BENCH_PEER). One worker process, REST and
gRPC; KServe's model server has no batcher of its own (batching is a separate sidecar), so none."""
from __future__ import annotations

import uuid
from typing import Any

import kserve
from kserve import InferOutput, InferRequest, InferResponse

from _onnx import Session, settings


class OnnxModel(kserve.Model):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg["name"])
        self.cfg = cfg
        self.load()

    def load(self) -> bool:
        self.session = Session(self.cfg)
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:
        inputs = {i.name: i.as_numpy() for i in payload.inputs}
        binary = payload.use_binary_outputs  # REST: binary_data_output asked for; gRPC: raw inputs came
        outputs = []
        for name, value in self.session.run(inputs).items():
            out = InferOutput(name=name, shape=list(value.shape), datatype="FP32")
            out.set_data_from_numpy(value, binary_data=binary)
            outputs.append(out)
        return InferResponse(model_name=self.name, infer_outputs=outputs, response_id=payload.id or str(uuid.uuid4()),
                             use_binary_outputs=binary)


def main() -> None:
    cfg = settings()
    kserve.ModelServer(http_port=cfg["http_port"], grpc_port=cfg["grpc_port"], workers=1,
                       enable_grpc=True).start([OnnxModel(cfg)])


if __name__ == "__main__":
    main()
