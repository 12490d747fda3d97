"""TensorFlow Serving REST codec: `instances` (row) / `inputs` (columnar) in, `predictions` /
`outputs` out, shaped the way TF Serving's REST API documents them, so existing clients work.
"""
from __future__ import annotations

import orjson
from typing import Any, Mapping, Sequence

import numpy as np

from kubetrt.runtime.package import TensorSpec

from . import json_arrays
from .errors import BadRequest
from .tensors import array_from_json, json_value

TF_DTYPES = {
    "float32": "DT_FLOAT",
    "float64": "DT_DOUBLE",
    "float16": "DT_HALF",
    "int8": "DT_INT8",
    "int16": "DT_INT16",
    "int32": "DT_INT32",
    "int64": "DT_INT64",
    "uint8": "DT_UINT8",
    "uint16": "DT_UINT16",
    "uint32": "DT_UINT32",
    "uint64": "DT_UINT64",
    "bool": "DT_BOOL",
    "object": "DT_STRING",
}
DEFAULT_SIGNATURE = "serving_default"


def decode_predict(
    body: bytes, inputs: Sequence[TensorSpec], signature: str = DEFAULT_SIGNATURE
) -> tuple[dict[str, np.ndarray], bool]:
    """-> (feeds, columnar). Row format stacks per-instance values on a new dim 0."""
    try:
        doc = json_arrays.loads_values(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON in the request body: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(doc).__name__}")
    sig = doc.get("signature_name")
    if sig is not None and sig not in (signature, DEFAULT_SIGNATURE):
        raise BadRequest(f"unknown signature_name {sig!r}; the model serves {signature!r}")
    if ("instances" in doc) == ("inputs" in doc):
        raise BadRequest("request must have exactly one of 'instances' (row format) or 'inputs' (columnar format)")
    specs = {t.name: t for t in inputs}
    if "instances" in doc:
        return _rows(doc["instances"], specs), False
    return _columns(doc["inputs"], specs), True


def _rows(instances: Any, specs: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    if not isinstance(instances, list) or not instances:
        raise BadRequest("'instances' must be a non-empty list")
    if isinstance(instances[0], dict) and not _is_b64(instances[0]):
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise BadRequest(f"instances[{i}] must be an object like instances[0]")
            _check_names(inst, specs, f"instances[{i}]")
        return {
            name: array_from_json([inst[name] for inst in instances], np.dtype(spec.dtype), f"input {name!r}")
            for name, spec in specs.items()
        }
    name = _single_input(specs, "instances")
    return {name: array_from_json(instances, np.dtype(specs[name].dtype), f"input {name!r}")}


def _columns(inputs: Any, specs: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    if isinstance(inputs, dict) and not _is_b64(inputs):
        _check_names(inputs, specs, "'inputs'")
        return {
            name: array_from_json(inputs[name], np.dtype(spec.dtype), f"input {name!r}")
            for name, spec in specs.items()
        }
    name = _single_input(specs, "inputs")
    return {name: array_from_json(inputs, np.dtype(specs[name].dtype), f"input {name!r}")}


def _is_b64(v: dict) -> bool:
    return len(v) == 1 and "b64" in v


def _check_names(given: Mapping[str, Any], specs: Mapping[str, TensorSpec], what: str) -> None:
    unknown = sorted(set(given) - set(specs))
    if unknown:
        raise BadRequest(f"{what}: unknown input(s) {unknown}; the model's inputs are {sorted(specs)}")
    missing = sorted(set(specs) - set(given))
    if missing:
        raise BadRequest(f"{what}: missing input(s) {missing}")


def _single_input(specs: Mapping[str, TensorSpec], what: str) -> str:
    if len(specs) != 1:
        raise BadRequest(
            f"'{what}' without input names needs a single-input model; this one takes {sorted(specs)}: "
            "name each input"
        )
    return next(iter(specs))


def encode_predict(results: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec], columnar: bool) -> bytes:
    names = [t.name for t in outputs]
    if columnar:
        value: Any = (
            json_value(results[names[0]])
            if len(names) == 1
            else {n: json_value(results[n]) for n in names}
        )
        return orjson.dumps({"outputs": value})
    if len(names) == 1:
        return orjson.dumps({"predictions": json_value(results[names[0]])})
    lists = {n: json_value(results[n]) for n in names}
    rows = {len(v) if isinstance(v, list) else -1 for v in lists.values()}
    if len(rows) != 1 or -1 in rows:
        raise BadRequest(
            "outputs do not share a batch dimension, so they cannot be returned as rows; use 'inputs' (columnar)"
        )
    (n_rows,) = rows
    predictions = [{n: lists[n][i] for n in names} for i in range(n_rows)]
    return orjson.dumps({"predictions": predictions})


def _tensor_info(t: TensorSpec) -> dict[str, Any]:
    return {
        "dtype": TF_DTYPES.get(str(t.dtype), "DT_INVALID"),
        "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in t.shape], "unknown_rank": False},
        "name": t.name,
    }


def model_metadata(
    name: str, version: str, signature: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> dict[str, Any]:
    sig = {
        "inputs": {t.name: _tensor_info(t) for t in inputs},
        "outputs": {t.name: _tensor_info(t) for t in outputs},
        "method_name": "tensorflow/serving/predict",
    }
    return {
        "model_spec": {"name": name, "signature_name": "", "version": version},
        "metadata": {"signature_def": {"signature_def": {signature or DEFAULT_SIGNATURE: sig}}},
    }


def model_status(version: str, state: str, error: str = "") -> dict[str, Any]:
    """state: AVAILABLE, LOADING or END (failed); error_code follows TF Serving's util.Status."""
    return {
        "model_version_status": [
            {
                "version": version,
                "state": state,
                "status": {"error_code": "OK" if not error else "UNKNOWN", "error_message": error},
            }
        ]
    }
