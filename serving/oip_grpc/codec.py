"""OIP gRPC codec: a ModelInferRequest becomes the same oip.InferRequest a REST body does, checked by
the same functions, and outputs go back as raw_output_contents (what Triton answers, and what
tritonclient and KServe's clients read first). Pure functions, as serving/oip.py."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from kubetrt.runtime.package import TensorSpec

from .. import oip
from ..errors import BadRequest
from ..tensors import array_from_json, element_count, oip_datatype
from . import ModelInferResponse, ModelMetadataResponse

# the typed-contents field each datatype travels in (FP16 has none: it travels raw only)
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """An InferParameter map as plain values (what REST's JSON 'parameters' hold)."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        choice = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, choice) if choice else None
    return out


def decode_infer_request(msg: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> oip.InferRequest:
    if not msg.inputs:
        raise BadRequest("'inputs' must be a non-empty list of tensors")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise BadRequest(f"raw_input_contents has {len(raw)} buffers for {len(msg.inputs)} inputs; "
                         "expected one per input, in input order")
    specs = {t.name: t for t in inputs}
    feeds: dict[str, np.ndarray] = {}
    for i, t in enumerate(msg.inputs):
        what = f"input {t.name!r}"
        dtype = oip.input_dtype(specs, feeds, t.name, t.datatype)
        shape = oip.check_shape(list(t.shape), what)
        if raw:
            if t.HasField("contents"):
                raise BadRequest(f"{what}: has both contents and raw_input_contents")
            feeds[t.name] = oip.from_raw(raw[i], dtype, shape, what)
        else:
            feeds[t.name] = _from_contents(t, dtype, shape, what)
    names = [o.name for o in outputs]
    if msg.outputs:
        requested = [oip.requested_output(o.name, parameters(o.parameters), names, True) for o in msg.outputs]
    else:
        requested = [(n, True) for n in names]
    return oip.InferRequest(msg.id or None, feeds, requested, parameters(msg.parameters))


def _from_contents(t: Any, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    field = CONTENTS_FIELD.get(t.datatype)
    if field is None:
        raise BadRequest(f"{what}: datatype {t.datatype} has no typed contents; send it in raw_input_contents")
    values = list(getattr(t.contents, field))
    n = element_count(shape)
    if len(values) != n:
        raise BadRequest(f"{what}: shape {list(shape)} needs {n} elements, {field} has {len(values)}")
    if t.datatype == "BYTES":
        arr = np.empty(n, dtype=object)
        arr[:] = values
        return arr.reshape(shape)
    return array_from_json(values, dtype, what).reshape(shape)


def encode_infer_response(model_name: str, model_version: str, request: oip.InferRequest,
                          results: Mapping[str, np.ndarray]) -> Any:
    resp = ModelInferResponse(model_name=model_name, model_version=model_version, id=request.id or "")
    for name, _ in request.outputs:
        arr = np.asarray(results[name])
        out = resp.outputs.add()
        out.name = name
        out.datatype = oip_datatype(arr.dtype)
        out.shape.extend(arr.shape)
        resp.raw_output_contents.append(oip.to_raw(arr))
    return resp


def model_metadata(name: str, version: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Any:
    resp = ModelMetadataResponse(name=name, versions=[version], platform="kubetrt")
    for specs, field in ((inputs, resp.inputs), (outputs, resp.outputs)):
        for t in oip.tensor_metadata(specs):
            field.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    return resp
