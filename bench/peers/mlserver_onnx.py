"""MLServer 1.7 custom runtime: model.onnx in onnxruntime at its defaults (bench/serving.py).

MLServer 1.7 ships no onnxruntime runtime (PyPI has no mlserver-onnx), so a model class is what a
user writes; it decodes and encodes with MLServer's NumpyCodec. MLServer's adaptive batching and
ports come from the settings files bench/serving.py writes."""
from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from _onnx import Session, settings


class OnnxRuntimeModel(MLModel):
    async def load(self) -> bool:
        self._session = Session(settings())
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        outputs = self._session.run(inputs)
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output(k, v) for k, v in outputs.items()])
