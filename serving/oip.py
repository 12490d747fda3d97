"""Open Inference Protocol (KServe V2) codec: request bytes -> feeds, outputs -> response bytes.

Pure functions with no web framework in sight, so they are tested directly and the routes stay
thin. Supports JSON tensors (flat or nested `data`) and the binary tensor extension: the body is a
JSON header of `Inference-Header-Content-Length` bytes followed by raw tensor blobs in input order
(`parameters.binary_data_size`), answered the same way for outputs that ask for `binary_data`.
Tensors may also lie in registered shared memory regions (shared_memory.py), named by their
parameters; such outputs are written there and the answer names the region.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from kubetrt.runtime.package import TensorSpec

from . import json_arrays
from .errors import BadRequest
from .shared_memory import BYTE_SIZE, OFFSET, REGION, SharedMemoryRegions, TensorRef, regions_or_refuse, tensor_ref
from .tensors import OIP_TO_NUMPY, array_from_json, element_count, is_count, json_value, oip_datatype

HEADER_LENGTH = "inference-header-content-length"
MAX_RANK = 32


@dataclass
class InferRequest:
    id: str | None
    feeds: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]  # (name, binary) in response order
    parameters: dict[str, Any]
    shared_outputs: dict[str, TensorRef] = field(default_factory=dict)  # outputs asked into shared memory


def decode_infer_request(
    body: bytes,
    header_length: int | None,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    regions: SharedMemoryRegions | None = None,
) -> InferRequest:
    """Parse and type-check an infer request against the model's signature (names, datatypes);
    `regions`: the registered shared memory, None where the server has it off."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length} is outside the body ({len(body)} bytes)"
            )
        header, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        header, binary = body, memoryview(b"")
    try:
        doc = json_arrays.loads_request(header)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON in the request body: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(doc).__name__}")
    req_id = doc.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise BadRequest(f"'id' must be a string, got {type(req_id).__name__}")
    params = _params(doc.get("parameters"), "request 'parameters'")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("'inputs' must be a non-empty list of tensors")

    specs = {t.name: t for t in inputs}
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(raw_inputs):
        if not isinstance(t, dict):
            raise BadRequest(f"inputs[{i}] must be an object, got {type(t).__name__}")
        name = t.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"inputs[{i}]: 'name' must be a string")
        datatype = t.get("datatype")
        what = f"input {name!r}"
        dtype = input_dtype(specs, feeds, name, datatype)
        shape = check_shape(t.get("shape"), what)
        tparams = _params(t.get("parameters"), f"{what} 'parameters'")
        size = tparams.get("binary_data_size")
        ref = tensor_ref(tparams, what)
        if ref is not None:
            if "data" in t or size is not None:
                raise BadRequest(f"{what}: names a shared memory region and also carries its data")
            arr = from_shared_memory(regions, ref, dtype, shape, what)
        elif size is not None:
            if "data" in t:
                raise BadRequest(f"{what}: has both 'data' and binary_data_size")
            if not is_count(size):
                raise BadRequest(f"{what}: binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise BadRequest(
                    f"{what}: binary_data_size {size} runs past the end of the binary data "
                    f"({len(binary) - offset} bytes left)"
                )
            arr = from_raw(binary[offset : offset + size], dtype, shape, what)
            offset += size
        else:
            if "data" not in t:
                raise BadRequest(f"{what}: has neither 'data' nor parameters.binary_data_size")
            try:
                arr = array_from_json(t["data"], dtype, what)
            except json_arrays.MalformedJSON as e:
                raise BadRequest(f"malformed JSON in the request body: {e}") from None
            n = element_count(shape)
            if arr.size != n:
                raise BadRequest(f"{what}: shape {list(shape)} needs {n} elements, data has {arr.size}")
            arr = arr.reshape(shape)
        feeds[name] = arr
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data follow the tensors that use them")

    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise BadRequest("parameter binary_data_output must be true or false")
    requested, shared = _requested_outputs(doc.get("outputs"), outputs, binary_default, regions)
    return InferRequest(req_id, feeds, requested, params, shared)


def from_shared_memory(regions: SharedMemoryRegions | None, ref: TensorRef, dtype: np.dtype,
                       shape: tuple[int, ...], what: str) -> np.ndarray:
    """An input that lies in a registered region, as a view of it (every transport's one read)."""
    found = regions_or_refuse(regions, what).read(ref, what)
    need = element_count(shape) * dtype.itemsize
    if dtype.kind != "O" and ref.byte_size != need:
        raise BadRequest(f"{what}: shape {list(shape)} of {oip_datatype(dtype)} needs {need} bytes, "
                         f"its {BYTE_SIZE} is {ref.byte_size}")
    return from_raw(found, dtype, shape, what)


def shared_output(regions: SharedMemoryRegions | None, name: str, params: Mapping[str, Any]) -> TensorRef | None:
    """Where an output is asked into shared memory (checked to lie in its region), else None."""
    what = f"output {name!r}"
    ref = tensor_ref(params, what)
    if ref is None:
        return None
    if params.get("binary_data") is True:
        raise BadRequest(f"{what}: asks for binary_data and for a shared memory region; expected one of the two")
    regions_or_refuse(regions, what).check_room(ref, what)
    return ref


def write_shared_output(regions: SharedMemoryRegions | None, name: str, ref: TensorRef,
                        arr: np.ndarray) -> dict[str, Any]:
    """An output's bytes into the region it was asked into -> the parameters that say where."""
    blob = to_raw(arr)
    regions_or_refuse(regions, f"output {name!r}").write(ref, blob, f"output {name!r}")
    where: dict[str, Any] = {REGION: ref.region, BYTE_SIZE: len(blob)}
    if ref.offset:
        where[OFFSET] = ref.offset
    return where


def input_dtype(specs: Mapping[str, TensorSpec], feeds: Mapping[str, Any], name: str, datatype: Any) -> np.dtype:
    """The dtype of a named input with its declared datatype, checked against the model's
    signature and the inputs already read (every transport's one check)."""
    spec = specs.get(name)
    if spec is None:
        raise BadRequest(f"unknown input {name!r}; the model's inputs are {sorted(specs)}")
    if name in feeds:
        raise BadRequest(f"input {name!r} is given twice")
    expected = oip_datatype(spec.dtype)
    if not isinstance(datatype, str) or datatype not in OIP_TO_NUMPY:
        raise BadRequest(f"input {name!r}: unknown datatype {datatype!r}; expected {expected}")
    if datatype != expected:
        raise BadRequest(f"input {name!r}: datatype {datatype} does not match the model's {expected}")
    return OIP_TO_NUMPY[datatype]


def _params(p: Any, what: str) -> dict[str, Any]:
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise BadRequest(f"{what} must be an object, got {type(p).__name__}")
    return p


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(is_count(d) for d in shape):
        raise BadRequest(f"{what}: 'shape' must be a list of at most {MAX_RANK} non-negative integers, got {shape!r}")
    return tuple(shape)


def from_raw(buf: memoryview | bytes, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    """A tensor's little-endian bytes (binary extension, gRPC raw contents) as a view, not a copy."""
    n = element_count(shape)
    if dtype.kind == "O":
        items = _unpack_bytes(buf, what)
        if len(items) != n:
            raise BadRequest(f"{what}: shape {list(shape)} needs {n} elements, binary data has {len(items)}")
        arr = np.empty(n, dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    need = n * dtype.itemsize
    if len(buf) != need:
        raise BadRequest(
            f"{what}: shape {list(shape)} of {oip_datatype(dtype)} needs {need} bytes, its binary data has {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dtype.newbyteorder("<")).reshape(shape)


def _unpack_bytes(buf: memoryview | bytes, what: str) -> list[bytes]:
    """BYTES binary layout: each element is a 4-byte little-endian length, then that many bytes."""
    items, i, end = [], 0, len(buf)
    while i < end:
        if i + 4 > end:
            raise BadRequest(f"{what}: truncated BYTES element length at byte {i}")
        (length,) = struct.unpack_from("<I", buf, i)
        i += 4
        if i + length > end:
            raise BadRequest(f"{what}: BYTES element of {length} bytes runs past its binary data")
        items.append(bytes(buf[i : i + length]))
        i += length
    return items


def pack_bytes(arr: np.ndarray) -> bytes:
    parts = []
    for v in arr.ravel().tolist():
        b = bytes(v) if isinstance(v, (bytes, bytearray)) else str(v).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def _requested_outputs(raw: Any, outputs: Sequence[TensorSpec], binary_default: bool,
                       regions: SharedMemoryRegions | None) -> tuple[list[tuple[str, bool]], dict[str, TensorRef]]:
    names = [t.name for t in outputs]
    if raw is None:
        return [(n, binary_default) for n in names], {}
    if not isinstance(raw, list):
        raise BadRequest(f"'outputs' must be a list, got {type(raw).__name__}")
    result, shared = [], {}
    for i, o in enumerate(raw):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise BadRequest(f"outputs[{i}] must be an object with a string 'name'")
        p = _params(o.get("parameters"), f"output {o['name']!r} 'parameters'")
        result.append(requested_output(o["name"], p, names, binary_default))
        ref = shared_output(regions, o["name"], p)
        if ref is not None:
            shared[o["name"]] = ref
    return result, shared


def requested_output(name: str, params: Mapping[str, Any], names: Sequence[str], binary_default: bool) -> tuple[str, bool]:
    """(name, binary) of one requested output, checked against the model's outputs."""
    if name not in names:
        raise BadRequest(f"unknown output {name!r} requested; the model's outputs are {list(names)}")
    if "classification" in params:
        raise BadRequest(f"output {name!r}: the classification extension is not supported")
    binary = params.get("binary_data", binary_default)
    if not isinstance(binary, bool):
        raise BadRequest(f"output {name!r}: binary_data must be true or false")
    return name, binary


def to_raw(arr: np.ndarray) -> bytes:
    """A tensor's raw form: little-endian values, or BYTES elements each after its 4-byte length."""
    if arr.dtype.kind in "OSU":
        return pack_bytes(arr)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def encode_infer_response(
    model_name: str,
    model_version: str,
    request: InferRequest,
    results: Mapping[str, np.ndarray],
    regions: SharedMemoryRegions | None = None,
) -> tuple[bytes, int | None]:
    """-> (body, Inference-Header-Content-Length or None when every output is JSON); outputs asked
    into shared memory are written there."""
    out_docs = []
    blobs: list[bytes] = []
    for name, binary in request.outputs:
        arr = np.asarray(results[name])
        doc: dict[str, Any] = {"name": name, "datatype": oip_datatype(arr.dtype), "shape": list(arr.shape)}
        ref = request.shared_outputs.get(name)
        if ref is not None:
            doc["parameters"] = write_shared_output(regions, name, ref, arr)
        elif binary:
            blob = to_raw(arr)
            doc["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif arr.dtype.kind in "biuf":
            doc["data"] = np.ascontiguousarray(arr).ravel()  # orjson writes it in C, no list in between
        else:
            doc["data"] = json_value(arr.ravel())
        out_docs.append(doc)
    resp: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": out_docs}
    if request.id is not None:
        resp["id"] = request.id
    header = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def tensor_metadata(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": t.name, "datatype": oip_datatype(t.dtype), "shape": list(t.shape)} for t in specs]
