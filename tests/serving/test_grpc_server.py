"""The OIP gRPC endpoint, driven by tritonclient.grpc (a client we did not write) against the live
server, beside REST on the same registry: same answers, same errors (as gRPC status codes), same
metrics, overload refused at once."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kubetrt.runtime.accuracy import TOLERANCES
from kubetrt.serving import oip_grpc
from kubetrt.serving.app import create_app
from kubetrt.serving.batcher import BatcherConfig
from kubetrt.serving.registry import ServingConfig
from serving_support import MAX_BODY, GatedModel, LiveServer, cnn_input, two_inputs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def grpc_server(cnn_package, two_package):
    config = ServingConfig(device="host", max_body_bytes=MAX_BODY, grpc_port=0)
    with LiveServer(create_app([cnn_package, two_package], config)) as s:
        s.wait_ready()
        yield s


@pytest.fixture
def gc(grpc_server):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.app.state.grpc_port}")
    yield c
    c.close()


def test_descriptor_set_is_what_protoc_makes_of_the_proto(tmp_path):
    out = tmp_path / "predict_v2.binpb"
    folder = REPO / "serving" / "oip_grpc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{folder}", f"--descriptor_set_out={out}",
                    str(folder / "predict_v2.proto")], check=True)
    assert out.read_bytes() == oip_grpc.DESCRIPTOR_SET.read_bytes(), "regenerate: see predict_v2.proto's header"


def _fields(desc, prefix=""):
    found = {}
    for f in desc.fields:
        entry = f.message_type is not None and f.message_type.GetOptions().map_entry
        found[prefix + f.name] = (f.number, f.type, "map" if entry else f.label)
        if f.message_type is not None and not entry and f.message_type.full_name.startswith("inference."):
            found.update(_fields(f.message_type, prefix + f.name + "."))
    return found


def test_messages_match_tritonclients_field_for_field():
    from tritonclient.grpc import service_pb2

    ours = oip_grpc._pool
    for rpc, (req, resp) in [*oip_grpc.METHODS.items(), *oip_grpc.STREAM_METHODS.items()]:
        for cls in (req, resp):
            name = cls.DESCRIPTOR.name
            assert _fields(cls.DESCRIPTOR) == _fields(service_pb2.DESCRIPTOR.message_types_by_name[name]), name
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for name, method in ours.FindServiceByName(oip_grpc.SERVICE).methods_by_name.items():
        assert (method.client_streaming, method.server_streaming) == (theirs[name].client_streaming, theirs[name].server_streaming), name


def test_health_and_metadata(gc):
    assert gc.is_server_live() and gc.is_server_ready() and gc.is_model_ready("small_cnn")
    assert gc.get_server_metadata().name == "kubetrt"
    md = gc.get_model_metadata("small_cnn")
    assert md.versions == ["1"] and md.platform == "kubetrt"
    assert [(t.name, t.datatype, list(t.shape)) for t in md.inputs] == [("image", "FP32", [-1, 32, 32, 3])]


def test_infer_answers_as_the_engine_and_as_rest_does(gc, grpc_server, cnn_model):
    x = cnn_input(3, seed=5)
    want = cnn_model.predict({"image": x})["output_0"]
    inp = grpcclient.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    got = gc.infer("small_cnn", [inp], request_id="r1")
    assert got.get_response().id == "r1"
    np.testing.assert_array_equal(got.as_numpy("output_0"), want)
    hc = httpclient.InferenceServerClient(grpc_server.host)
    for binary in (False, True):
        h = httpclient.InferInput("image", list(x.shape), "FP32")
        h.set_data_from_numpy(x, binary_data=binary)
        r = hc.infer("small_cnn", [h], outputs=[httpclient.InferRequestedOutput("output_0", binary_data=binary)])
        np.testing.assert_array_equal(r.as_numpy("output_0"), want)


def test_two_inputs_and_a_chosen_output(gc, two_model):
    feeds = two_inputs(2, seed=3)
    inputs = []
    for name, dtype in (("features", "FP32"), ("ids", "INT32")):
        i = grpcclient.InferInput(name, list(feeds[name].shape), dtype)
        i.set_data_from_numpy(feeds[name])
        inputs.append(i)
    want = two_model.predict(feeds)
    out_name = sorted(want)[-1]
    r = gc.infer("two_in_two_out", inputs, outputs=[grpcclient.InferRequestedOutput(out_name)])
    assert [o.name for o in r.get_response().outputs] == [out_name]
    np.testing.assert_array_equal(r.as_numpy(out_name), want[out_name])


def test_typed_contents_are_read_too(gc, grpc_server, cnn_model):
    x = cnn_input(1, seed=9)
    req = oip_grpc.ModelInferRequest(model_name="small_cnn")
    t = req.inputs.add(name="image", datatype="FP32", shape=list(x.shape))
    t.contents.fp32_contents.extend(x.ravel().tolist())
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.app.state.grpc_port}") as ch:
        call = ch.unary_unary(f"/{oip_grpc.SERVICE}/ModelInfer", request_serializer=type(req).SerializeToString,
                              response_deserializer=oip_grpc.ModelInferResponse.FromString)
        resp = call(req, timeout=30)
    got = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(list(resp.outputs[0].shape))
    np.testing.assert_array_equal(got, cnn_model.predict({"image": x})["output_0"])


@pytest.mark.parametrize("case, code, message", [
    ("wrong shape", "INVALID_ARGUMENT", "input 'image': expected shape"),
    ("wrong datatype", "INVALID_ARGUMENT", "datatype FP64 does not match the model's FP32"),
    ("unknown model", "NOT_FOUND", "unknown model 'nope'"),
    ("unknown output", "INVALID_ARGUMENT", "unknown output 'nope' requested"),
])
def test_errors_are_the_rest_errors_as_status_codes(gc, case, code, message):
    x = cnn_input(1)
    model, outputs = "small_cnn", None
    if case == "wrong shape":
        x = np.zeros((1, 32, 32, 4), np.float32)
    inp = grpcclient.InferInput("image", list(x.shape), "FP64" if case == "wrong datatype" else "FP32")
    inp.set_data_from_numpy(x.astype(np.float64) if case == "wrong datatype" else x)
    if case == "unknown model":
        model = "nope"
    if case == "unknown output":
        outputs = [grpcclient.InferRequestedOutput("nope")]
    with pytest.raises(InferenceServerException) as e:
        gc.infer(model, [inp], outputs=outputs)
    assert e.value.status() == f"StatusCode.{code}" and message in e.value.message()


def test_metrics_count_grpc_calls(gc, grpc_server):
    def successes() -> float:
        text = httpx.get(grpc_server.url + "/metrics").text
        line = next(line for line in text.splitlines()
                    if line.startswith('kubetrt_inference_requests_total{model="small_cnn",outcome="success"}'))
        return float(line.split()[-1])

    before = successes()
    inp = grpcclient.InferInput("image", [1, 32, 32, 3], "FP32")
    inp.set_data_from_numpy(cnn_input(1))
    for _ in range(3):
        gc.infer("small_cnn", [inp])
    assert successes() == before + 3


def test_a_full_queue_is_refused_at_once_on_both_transports(cnn_model):
    gated = GatedModel(cnn_model)
    config = ServingConfig(batcher=BatcherConfig(max_batch_size=1, max_queue_size=2), grpc_port=0)
    with LiveServer(create_app(config=config, models=[gated])) as live:
        live.wait_ready()
        gated.armed = True
        x = cnn_input(1)
        inp = grpcclient.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{live.app.state.grpc_port}")
        waiting = [threading.Thread(target=c.infer, args=("small_cnn", [inp])) for _ in range(3)]
        try:
            waiting[0].start()
            assert gated.entered.wait(10)
            for t in waiting[1:]:
                t.start()
            deadline = 100
            while live.registry.get("small_cnn").batcher.queued < 2 and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
            with pytest.raises(InferenceServerException) as e:
                c.infer("small_cnn", [inp], client_timeout=5)
            assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "queue is full" in e.value.message()
            r = httpx.post(live.url + "/v2/models/small_cnn/infer", timeout=5, json={"inputs": [
                {"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
            assert r.status_code == 503 and "queue is full" in r.json()["error"] and r.headers["retry-after"] == "1"
            metrics = httpx.get(live.url + "/metrics").text
            assert 'kubetrt_queue_depth{model="small_cnn"} 2.0' in metrics
            assert 'kubetrt_inference_requests_total{model="small_cnn",outcome="overloaded"} 2.0' in metrics
        finally:
            gated.gate.set()
            for t in waiting:
                t.join(30)
            c.close()


def test_the_standard_health_service_says_what_readiness_says(grpc_server, cnn_package, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    def check(port: int, service: str) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    serving = health_pb2.HealthCheckResponse.SERVING
    port = grpc_server.app.state.grpc_port
    assert check(port, "") == check(port, "inference.GRPCInferenceService") == check(port, "small_cnn") == serving
    with pytest.raises(grpc.RpcError) as e:
        check(port, "nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in e.value.details()

    broken = tmp_path / "pkg"
    shutil.copytree(cnn_package, broken)
    (broken / "model.onnx").write_bytes(b"not onnx")  # the runtime refuses it: never ready
    with LiveServer(create_app([broken], ServingConfig(grpc_port=0))) as live:
        deadline = time.monotonic() + 60
        while live.registry.get("small_cnn").state.value == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert check(live.app.state.grpc_port, "") == check(live.app.state.grpc_port, "small_cnn") == not_serving


def _stream_inputs(x: np.ndarray) -> list[Any]:
    inp = grpcclient.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [inp]


def test_a_stream_of_inferences_answers_each_and_one_failure_does_not_end_it(grpc_server, cnn_model):
    """tritonclient.grpc's streaming API (Triton's ModelStreamInfer): every request answered on the
    stream with its own id and the engine's outputs (within the host's fp32 tolerance: requests that
    queued together ran as one batch); a request with a wrong shape is answered with its error while
    the ones after it are still served."""
    got: dict[str, Any] = {}
    errors: list[InferenceServerException] = []
    done = threading.Semaphore(0)

    def on_answer(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(error)
        else:
            got[result.get_response().id] = result.as_numpy("output_0")
        done.release()

    xs = {f"r{i}": cnn_input(1 + i % 3, seed=i) for i in range(8)}
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.app.state.grpc_port}")
    try:
        c.start_stream(callback=on_answer)
        for i, (rid, x) in enumerate(xs.items()):
            c.async_stream_infer("small_cnn", _stream_inputs(x), request_id=rid)
            if i == 3:
                c.async_stream_infer("small_cnn", _stream_inputs(np.zeros((1, 8, 8, 3), np.float32)), request_id="bad")
        for _ in range(len(xs) + 1):
            assert done.acquire(timeout=30), f"answers so far: {sorted(got)}, errors {errors}"
        c.stop_stream()
    finally:
        c.close()
    assert sorted(got) == sorted(xs)
    tol = TOLERANCES[("fp32", "host")]
    for rid, x in xs.items():
        np.testing.assert_allclose(got[rid], cnn_model.predict({"image": x})["output_0"], rtol=tol, atol=tol, err_msg=rid)
    assert len(errors) == 1 and "image" in errors[0].message() and "shape" in errors[0].message()


def test_a_stream_of_inferences_is_batched_as_separate_calls_are(cnn_model):
    """Requests sent on one stream while the model is busy queue and run together, as they would
    from separate clients: the stream does not wait for each answer before starting the next."""
    gated = GatedModel(cnn_model)
    config = ServingConfig(batcher=BatcherConfig(max_batch_size=8), grpc_port=0)
    answers: list[Any] = []
    all_in = threading.Event()

    def on_answer(result: Any, error: Any) -> None:
        answers.append(error or result.get_response().id)
        if len(answers) == 6:
            all_in.set()

    with LiveServer(create_app(config=config, models=[gated])) as live:
        live.wait_ready()
        gated.armed = True
        before = len(gated.calls)  # loading runs the model too
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{live.app.state.grpc_port}")
        try:
            c.start_stream(callback=on_answer)
            c.async_stream_infer("small_cnn", _stream_inputs(cnn_input(1)), request_id="first")
            assert gated.entered.wait(10)
            for i in range(5):
                c.async_stream_infer("small_cnn", _stream_inputs(cnn_input(1, seed=i)), request_id=f"then{i}")
            deadline = time.monotonic() + 10
            while live.registry.get("small_cnn").batcher.queued < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            gated.gate.set()
            assert all_in.wait(30), answers
            c.stop_stream()
        finally:
            gated.gate.set()
            c.close()
    assert answers == ["first", *(f"then{i}" for i in range(5))]
    first, batch = gated.calls[before:]  # two runs, the second holding all five (padded to a planned size)
    assert first == 1 and batch >= 5
