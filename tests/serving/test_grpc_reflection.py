"""Server reflection on the gRPC endpoint, asked by two clients we did not write: grpcio-reflection's
descriptor database (the v1alpha protocol, what Python tools use) and grpcurl (v1, what people type
first). Each lists the services the server answers and reads their protos from the server alone,
then calls ModelInfer with messages built from what it read; the answers are the engine's."""
from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kubetrt.serving import oip_grpc
from kubetrt.serving.app import create_app
from kubetrt.serving.oip_grpc import reflection
from kubetrt.serving.registry import ServingConfig
from serving_support import MAX_BODY, LiveServer, cnn_input

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted(["inference.GRPCInferenceService", "grpc.health.v1.Health",
                   "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])


@pytest.fixture(scope="module")
def target(cnn_package) -> Iterator[str]:
    config = ServingConfig(device="host", max_body_bytes=MAX_BODY, grpc_port=0)
    with LiveServer(create_app([cnn_package], config)) as s:
        s.wait_ready()
        yield f"127.0.0.1:{s.app.state.grpc_port}"


@pytest.fixture(scope="module")
def grpcurl() -> str:
    built = subprocess.run(["bash", str(REPO / "scripts" / "get-go-tool.sh"), "grpcurl"], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    return built.stdout.strip()


def _infer_request(cls: Any, x: np.ndarray) -> Any:
    req = cls(model_name="small_cnn", id="by-reflection")
    t = req.inputs.add(name="image", datatype="FP32", shape=list(x.shape))
    t.contents.fp32_contents.extend(x.ravel().tolist())
    return req


def test_a_client_with_only_reflection_lists_reads_and_calls(target, cnn_model):
    x = cnn_input(2, seed=4)
    with grpc.insecure_channel(target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        assert sorted(db.get_services()) == SERVICES
        pool = descriptor_pool.DescriptorPool(db)
        oip = pool.FindServiceByName("inference.GRPCInferenceService")
        assert sorted(oip.methods_by_name) == sorted([*oip_grpc.METHODS, *oip_grpc.STREAM_METHODS])
        check = pool.FindServiceByName("grpc.health.v1.Health").methods_by_name["Check"]
        assert (check.input_type.full_name, check.output_type.full_name) == (
            "grpc.health.v1.HealthCheckRequest", "grpc.health.v1.HealthCheckResponse")
        infer = oip.methods_by_name["ModelInfer"]
        request_cls = message_factory.GetMessageClass(infer.input_type)
        response_cls = message_factory.GetMessageClass(infer.output_type)
        rpc = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                             request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString)
        got = rpc(_infer_request(request_cls, x), timeout=30)
    assert got.id == "by-reflection" and [o.name for o in got.outputs] == ["output_0"]
    out = np.frombuffer(got.raw_output_contents[0], np.float32).reshape(tuple(got.outputs[0].shape))
    np.testing.assert_array_equal(out, cnn_model.predict({"image": x})["output_0"])


def test_a_symbol_the_server_does_not_have_is_not_found(target):
    with grpc.insecure_channel(target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        with pytest.raises(KeyError):
            db.FindFileContainingSymbol("inference.NoSuchMessage")
        with pytest.raises(KeyError):
            db.FindFileByName("no/such.proto")
        assert db.FindFileContainingSymbol("inference.ModelInferRequest.InferInputTensor").name == "predict_v2.proto"


def test_the_answers_name_each_asked_thing_and_say_what_a_request_lacks():
    Request = oip_grpc.message_class("ServerReflectionRequest", "grpc.reflection.v1")
    services = ["a.A"]
    assert reflection.answer(Request(list_services=""), services) == ("list_services_response", {"service": [{"name": "a.A"}]})
    field, value = reflection.answer(Request(file_containing_symbol="inference.GRPCInferenceService.ModelInfer"), services)
    assert field == "file_descriptor_response" and len(value["file_descriptor_proto"]) == 1
    assert reflection.answer(Request(all_extension_numbers_of_type="inference.ModelInferRequest"), services) == (
        "all_extension_numbers_response", {"base_type_name": "inference.ModelInferRequest", "extension_number": []})
    for request, says in ((Request(file_containing_symbol="inference.GRPCInferenceService.Nope"), "inference.GRPCInferenceService.Nope"),
                          (Request(all_extension_numbers_of_type="x.Y"), "x.Y"), (Request(), "expected one of list_services")):
        field, value = reflection.answer(request, services)
        assert field == "error_response" and says in value["error_message"], value


def _grpcurl(grpcurl: str, target: str, *args: str, data: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [grpcurl, "-plaintext", "-max-time", "30", *(["-d", "@"] if data is not None else []), target, *args]
    return subprocess.run(cmd, input=data, capture_output=True, text=True, timeout=60)


def test_grpcurl_lists_describes_and_calls_by_reflection(target, grpcurl, cnn_model):
    listed = _grpcurl(grpcurl, target, "list")
    assert listed.returncode == 0 and sorted(listed.stdout.split()) == SERVICES, listed.stderr
    described = _grpcurl(grpcurl, target, "describe", "inference.GRPCInferenceService.ModelInfer")
    assert "rpc ModelInfer ( .inference.ModelInferRequest ) returns ( .inference.ModelInferResponse )" in described.stdout, described.stderr
    x = cnn_input(1, seed=8)
    body = {"model_name": "small_cnn", "inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape),
                                                   "contents": {"fp32_contents": x.ravel().tolist()}}]}
    called = _grpcurl(grpcurl, target, "inference.GRPCInferenceService/ModelInfer", data=json.dumps(body))
    assert called.returncode == 0, called.stderr
    answer = json.loads(called.stdout)
    out = np.frombuffer(base64.b64decode(answer["rawOutputContents"][0]), np.float32).reshape([int(d) for d in answer["outputs"][0]["shape"]])
    np.testing.assert_array_equal(out, cnn_model.predict({"image": x})["output_0"])
    missing = _grpcurl(grpcurl, target, "describe", "inference.NoSuchThing")
    assert missing.returncode != 0 and "inference.NoSuchThing" in missing.stderr and "not found" in missing.stderr.lower()
