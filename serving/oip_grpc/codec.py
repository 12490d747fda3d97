"""OIP gRPC codec: a ModelInferRequest becomes the same oip.InferRequest a REST body does, checked by
the same functions, and outputs go back as raw_output_contents (what Triton answers, and what
tritonclient and KServe's clients read first). Inputs and outputs in shared memory as REST's
are; raw contents go to the inputs that name no region, in order, and an output written to a
region keeps its place in raw_output_contents with no bytes, as Triton answers. Pure functions,
as serving/oip.py."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from kubetrt.runtime.package import TensorSpec

from .. import oip
from ..errors import BadRequest
from ..shared_memory import SharedMemoryRegions, tensor_ref
from ..tensors import array_from_json, element_count, oip_datatype
from . import ModelInferRequest, ModelInferResponse, ModelMetadataResponse

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


RAW_INPUT_CONTENTS = 7  # ModelInferRequest's field number of raw_input_contents (predict_v2.proto)
SPLIT_MIN_BYTES = 32 << 10  # smaller messages are parsed whole: copying them costs less than walking their fields


class InferMessage(NamedTuple):
    """A ModelInferRequest read with its raw_input_contents left where they arrived."""
    msg: Any  # the ModelInferRequest without its raw_input_contents
    raw: Sequence[memoryview | bytes]  # each input's bytes, in input order


def read_infer_request(message: memoryview) -> InferMessage:
    """Parse a ModelInferRequest, its raw_input_contents as views of `message`: protobuf's parser
    would copy each into the message and copy it again on every read of the field, and those
    bytes are most of a large request. Raises DecodeError where the message is no valid protobuf."""
    split = split_raw_input_contents(message) if len(message) >= SPLIT_MIN_BYTES else None
    if split is None:  # small, or not well formed (then the parser says what is wrong)
        msg = ModelInferRequest.FromString(message)
        return InferMessage(msg, msg.raw_input_contents)
    rest, raw = split
    return InferMessage(ModelInferRequest.FromString(rest), raw)


def split_raw_input_contents(message: memoryview) -> tuple[bytes, list[memoryview]] | None:
    """(the message's other fields' bytes, each raw_input_contents as a view of `message`) from a walk
    of its top-level fields by the protobuf wire format; None where the walk finds no valid message."""
    rest: list[memoryview] = []
    raw: list[memoryview] = []
    at, end, kept = 0, len(message), 0
    try:
        while at < end:
            field = at
            key, at = _varint(message, at)
            wire = key & 7
            if wire == 2:  # length-delimited
                n, at = _varint(message, at)
                if key >> 3 == RAW_INPUT_CONTENTS and at + n <= end:
                    raw.append(message[at:at + n])
                    rest.append(message[kept:field])
                    kept = at + n
                at += n
            elif wire == 0:
                _, at = _varint(message, at)
            elif wire in (1, 5):  # fixed 64 and 32 bits
                at += 8 if wire == 1 else 4
            else:  # groups, deprecated, and no field of this message
                return None
    except IndexError:
        return None
    if at != end:
        return None
    rest.append(message[kept:end])
    return b"".join(rest), raw


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    """The base-128 varint at `at` -> (its value, the index after it); IndexError past the end or
    the ten bytes a varint may take."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise IndexError("a varint longer than ten bytes")


def decode_infer_request(request: InferMessage, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                         regions: SharedMemoryRegions | None = None) -> oip.InferRequest:
    msg, raw = request
    if not msg.inputs:
        raise BadRequest("'inputs' must be a non-empty list of tensors")
    refs = [tensor_ref(parameters(t.parameters), f"input {t.name!r}") for t in msg.inputs]
    if raw and len(raw) != refs.count(None):
        raise BadRequest(f"raw_input_contents has {len(raw)} buffers for {refs.count(None)} inputs not in shared "
                         "memory; expected one per such input, in input order")
    specs = {t.name: t for t in inputs}
    feeds: dict[str, np.ndarray] = {}
    next_raw = iter(raw)
    for t, ref in zip(msg.inputs, refs):
        what = f"input {t.name!r}"
        dtype = oip.input_dtype(specs, feeds, t.name, t.datatype)
        shape = oip.check_shape(list(t.shape), what)
        if ref is not None:
            if t.HasField("contents"):
                raise BadRequest(f"{what}: names a shared memory region and also carries contents")
            feeds[t.name] = oip.from_shared_memory(regions, ref, dtype, shape, what)
        elif raw:
            if t.HasField("contents"):
                raise BadRequest(f"{what}: has both contents and raw_input_contents")
            feeds[t.name] = oip.from_raw(next(next_raw), dtype, shape, what)
        else:
            feeds[t.name] = _from_contents(t, dtype, shape, what)
    names = [o.name for o in outputs]
    shared = {}
    if msg.outputs:
        requested = []
        for o in msg.outputs:
            params = parameters(o.parameters)
            requested.append(oip.requested_output(o.name, params, names, True))
            ref = oip.shared_output(regions, o.name, params)
            if ref is not None:
                shared[o.name] = ref
    else:
        requested = [(n, True) for n in names]
    return oip.InferRequest(msg.id or None, feeds, requested, parameters(msg.parameters), shared)


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
                          results: Mapping[str, np.ndarray], regions: SharedMemoryRegions | None = None) -> Any:
    resp = ModelInferResponse(model_name=model_name, model_version=model_version, id=request.id or "")
    for name, _ in request.outputs:
        arr = np.asarray(results[name])
        out = resp.outputs.add()
        out.name = name
        out.datatype = oip_datatype(arr.dtype)
        out.shape.extend(arr.shape)
        ref = request.shared_outputs.get(name)
        if ref is None:
            resp.raw_output_contents.append(oip.to_raw(arr))
            continue
        for key, value in oip.write_shared_output(regions, name, ref, arr).items():
            if isinstance(value, str):
                out.parameters[key].string_param = value
            else:
                out.parameters[key].int64_param = value
        resp.raw_output_contents.append(b"")
    return resp


def model_metadata(name: str, version: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Any:
    resp = ModelMetadataResponse(name=name, versions=[version], platform="kubetrt")
    for specs, field in ((inputs, resp.inputs), (outputs, resp.outputs)):
        for t in oip.tensor_metadata(specs):
            field.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    return resp
