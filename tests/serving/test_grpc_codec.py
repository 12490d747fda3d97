"""Reading a ModelInferRequest with its raw_input_contents left in place: the same message protobuf's
own parser reads, every raw buffer a view of the request's bytes, malformed messages refused."""
from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from kubetrt.runtime.package import TensorSpec
from kubetrt.serving.oip_grpc import ModelInferRequest, codec


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


UNKNOWN = bytes([15 << 3 | 0, 0x96, 0x01]) + _varint(16 << 3 | 5) + b"\x01\x02\x03\x04"  # a newer client's fields


def _wire(seed: int) -> bytes:
    """A request with every kind of field around its raw buffers (strings, a map, repeated messages,
    unknown fields between the buffers), as bytes on the wire."""
    rng = random.Random(seed)
    msg = ModelInferRequest(model_name=f"m{seed}", model_version="3", id="x" * rng.randrange(0, 300))
    msg.parameters["priority"].int64_param = rng.randrange(-5, 1 << 40)
    msg.parameters["flag"].bool_param = True
    raw = []
    for k in range(rng.randrange(1, 4)):
        t = msg.inputs.add(name=f"in{k}", datatype="FP32", shape=[1, rng.randrange(1, 20_000)])
        t.parameters["binary_data_size"].int64_param = 4 * t.shape[1]
        raw.append(rng.randbytes(4 * t.shape[1]))
    msg.outputs.add(name="out").parameters["binary_data"].bool_param = True
    fields = [bytes([7 << 3 | 2]) + _varint(len(r)) + r for r in raw]  # raw_input_contents, field 7
    return UNKNOWN + b"".join(f + UNKNOWN for f in fields[:1]) + msg.SerializeToString() + b"".join(fields[1:])


@pytest.fixture(params=["split", "whole"])
def split_min(request, monkeypatch):
    """Both ways of reading: raw buffers split off (every message), protobuf's parser (none)."""
    monkeypatch.setattr(codec, "SPLIT_MIN_BYTES", 0 if request.param == "split" else 1 << 62)
    return request.param


@pytest.mark.parametrize("seed", range(20))
def test_the_request_reads_as_protobuf_reads_it(seed, split_min):
    wire = bytearray(_wire(seed))
    original = ModelInferRequest.FromString(bytes(wire))  # the reference
    got = codec.read_infer_request(memoryview(wire))
    assert [bytes(r) for r in got.raw] == list(original.raw_input_contents)
    assert _without_raw(got.msg) == _without_raw(original)
    assert _without_raw(got.msg).SerializeToString() == _without_raw(original).SerializeToString()  # unknown fields kept too


def _without_raw(msg: ModelInferRequest) -> ModelInferRequest:
    copy = ModelInferRequest()
    copy.CopyFrom(msg)
    del copy.raw_input_contents[:]
    return copy


def test_raw_buffers_of_a_large_request_are_views_of_its_bytes_not_copies():
    wire = bytearray(_wire(1))
    assert len(wire) >= codec.SPLIT_MIN_BYTES
    got = codec.read_infer_request(memoryview(wire))
    spec = [TensorSpec(t.name, "float32", (-1, int(t.shape[1]))) for t in got.msg.inputs]
    feeds = codec.decode_infer_request(got, spec, [TensorSpec("out", "float32", (-1, 1))]).feeds
    first = feeds["in0"]
    at = bytes(wire).index(bytes(got.raw[0]))
    wire[at:at + 4] = np.float32(1234.5).tobytes()  # the request's bytes change under the feed
    assert first.ravel()[0] == np.float32(1234.5)


def test_a_request_without_raw_contents_reads_the_same(split_min):
    msg = ModelInferRequest(model_name="m")
    msg.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([1.0, 2.0])
    got = codec.read_infer_request(memoryview(msg.SerializeToString()))
    assert len(got.raw) == 0 and got.msg == msg and got.msg.SerializeToString() == msg.SerializeToString()


def test_a_request_with_a_group_field_reads_as_protobuf_reads_it(split_min):
    """Groups (deprecated; no field of this message) are left to protobuf's parser, which skips them."""
    group = _varint(20 << 3 | 3) + bytes([1 << 3 | 0, 5]) + _varint(20 << 3 | 4)
    wire = group + _wire(3)
    original = ModelInferRequest.FromString(wire)
    got = codec.read_infer_request(memoryview(wire))
    assert [bytes(r) for r in got.raw] == list(original.raw_input_contents) and len(got.raw) >= 1


@pytest.mark.parametrize("cut", ["truncated", "bad varint", "past the end"])
def test_a_malformed_message_is_refused_as_protobuf_refuses_it(cut, split_min):
    wire = _wire(2)
    bad = {"truncated": wire[:-7], "bad varint": b"\x0a" + b"\xff" * 11,
           "past the end": bytes([7 << 3 | 2]) + _varint(100) + bytes(99)}[cut]
    with pytest.raises(DecodeError):
        ModelInferRequest.FromString(bad)  # the reference
    with pytest.raises(DecodeError):
        codec.read_infer_request(memoryview(bad))
