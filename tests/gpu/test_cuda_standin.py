"""The cuda runtime's kernels, device plan, tuning and engine files, run with NumPy standing in
for CuPy: a fake at the GPU boundary (no streams, no CUDA Graphs, no ElementwiseKernel), checked
against TensorFlow's golden outputs. The GPU-only parts are in test_cuda_gpu.py and
bench/gpu_check.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import check_all_batches, fresh, load
from kubetrt.runtime import load_model, ops
from kubetrt.runtime import accuracy
from kubetrt.runtime.devices import cuda, cudnn, resolve_target
from kubetrt.runtime.engine import build_engine
from kubetrt.runtime.package import open_package
from kubetrt.runtime.devices.cuda import (
    CaptureUnsafe,
    CudaRuntime,
    NumpyStandIn,
    gfd_product,
)
from kubetrt.runtime.errors import KernelError
from kubetrt.runtime.kernels import cuda as ck
from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.target import BatchProfile, Target, TargetError
from onnx import helper

STAND_IN = CudaRuntime(NumpyStandIn())
MODELS = ["small_cnn", "mlp", "transformer", "two_in_two_out"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("algo", ["im2col", "shifted"])
def test_cuda_kernels_numpy_stand_in_fp32_matches_golden(zoo, name: str, algo: str) -> None:
    graph, golden = load(zoo.package(name))
    exe = STAND_IN.prepare(graph, {"precision": "fp32", "conv_algo": algo})
    assert exe.plan.fallback_ops == [] and exe.plan.capturable, exe.plan.sync_reasons
    check_all_batches(exe.run, graph, golden, 1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_cuda_kernels_numpy_stand_in_fp16_matches_golden(zoo, name: str) -> None:
    graph, golden = load(zoo.package(name))
    exe = STAND_IN.prepare(graph, {"precision": "fp16"})
    if name == "small_cnn":  # weights really are half precision on the device
        assert all(v.dtype == np.float16 for v in exe.plan.dev_consts.values() if v.dtype.kind == "f")
    check_all_batches(exe.run, graph, golden, 1e-2)
    for out in exe.run([golden[1][0][v.name] for v in graph.inputs]):
        assert out.dtype != np.float16, "fp16 runs return the model's declared output dtype"


def test_cuda_kernels_numpy_stand_in_fp16_is_really_reduced_precision(zoo) -> None:
    graph, golden = load(zoo.package("transformer"))
    ins, outs = golden[4]
    fp32 = STAND_IN.prepare(fresh(graph), {"precision": "fp32"}).run([ins["embeddings"]])[0]
    fp16 = STAND_IN.prepare(fresh(graph), {"precision": "fp16"}).run([ins["embeddings"]])[0]
    e32, e16 = np.abs(fp32 - outs["output_0"]).max(), np.abs(fp16 - outs["output_0"]).max()
    assert e16 > 10 * e32


@pytest.mark.slow
def test_cuda_kernels_numpy_stand_in_resnet50_fp32(zoo) -> None:
    graph, golden = load(zoo.package("resnet50"))
    check_all_batches(STAND_IN.prepare(graph, {"precision": "fp32"}).run, graph, golden, 1e-4)


def _shape_scaled_graph():  # type: ignore[no-untyped-def]
    """y = x * float(shape(x)[1]) + mean(x): shape arithmetic on the host feeding device math."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "one"], ["d"], name="gather", axis=0),
             helper.make_node("Cast", ["d"], ["df"], name="cast", to=1),
             helper.make_node("Mul", ["x", "df"], ["m"], name="mul"),
             helper.make_node("Reshape", ["m", "shape2"], ["y"], name="reshape")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [None, 4])],
                          [helper.make_tensor_value_info("y", 1, None)],
                          initializer=[helper.make_tensor("one", 7, [], [1]), helper.make_tensor("shape2", 7, [2], [-1, 2])])
    return from_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_cuda_stand_in_shape_arithmetic_stays_on_host_and_replays_without_transfers() -> None:
    """What makes CUDA Graph capture possible: host shape values are uploaded once per shape and
    cached, so a capturing run after a warm-up with the same shapes transfers nothing."""
    plan = STAND_IN.prepare(_shape_scaled_graph(), {}).plan
    assert [st.kind for st in plan.steps] == ["host", "host", "host", "device", "device"] and plan.capturable
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with pytest.raises(CaptureUnsafe):
        plan.run_device([x], capturing=True)  # cold cache: the upload would be captured
    plan.run_device([x])
    plan.ctx.upload = lambda a: (_ for _ in ()).throw(AssertionError("upload during capture"))  # type: ignore[method-assign]
    (y,) = plan.run_device([x], capturing=True)
    np.testing.assert_array_equal(y, (x * 4).reshape(-1, 2))


def test_cuda_stand_in_transformer_plan_keeps_shape_ops_on_host(zoo) -> None:
    graph, golden = load(zoo.package("transformer"))
    plan = STAND_IN.prepare(graph, {}).plan
    host_ops = {st.op for st in plan.steps if st.kind == "host"}
    assert "Shape" in host_ops and plan.capturable
    assert all(st.kind == "device" for st in plan.steps if st.op in ("FusedMatMul", "MatMul", "Softmax"))


def test_cuda_stand_in_ops_without_device_kernel_fall_back_and_disable_capture() -> None:
    x = np.array([[3.0, 1.0, 2.0, 5.0]], np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("TopK", ["r", "k"], ["v", "i"], name="topk", axis=-1),
             helper.make_node("Neg", ["v"], ["y"], name="neg")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [None, 4])],
                          [helper.make_tensor_value_info("y", 1, None), helper.make_tensor_value_info("i", 7, None)],
                          initializer=[helper.make_tensor("k", 7, [1], [2])])
    graph = from_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    exe = STAND_IN.prepare(graph, {})
    assert exe.plan.fallback_ops == ["TopK"] and not exe.plan.capturable
    y, i = exe.run([x])
    np.testing.assert_array_equal(y, [[-5.0, -3.0]])
    np.testing.assert_array_equal(i, [[3, 0]])


def test_cuda_stand_in_tune_picks_an_accurate_candidate_and_refuses_when_none_is(zoo, monkeypatch) -> None:
    graph, golden = load(zoo.package("small_cnn"))
    target = Target("cuda", "NumPy-Stand-In", "fp16", BatchProfile(1, 4, 4)).resolve("0.0", "x")
    options = STAND_IN.tune(fresh(graph), target, golden, repeats=2)
    assert options["conv_algo"] in ("im2col", "shifted") and options["precision"] == "fp16"
    assert set(options["candidates"]) == {"im2col", "shifted"}
    tuning = json.loads(options["_files"][cuda.TUNING_FILE])
    assert tuning["choice"]["conv_algo"] == options["conv_algo"]
    monkeypatch.setitem(accuracy.TOLERANCES, ("fp16", "gpu"), 1e-9)
    with pytest.raises(KernelError, match="no cuda configuration matches the golden outputs"):
        STAND_IN.tune(fresh(graph), target, golden, repeats=1)


@pytest.mark.parametrize("name, host_ops", [("cumsum", {"CumSum"}), ("control_flow", {"Loop", "If"})])
def test_cuda_falls_back_to_host_for_ops_without_cuda_kernel_and_reports_it(zoo, tmp_path, monkeypatch, name: str,
                                                                            host_ops: set[str]) -> None:
    """TF-TRT style: nodes the cuda runtime has no kernel for run on the host; the build report
    names them, and the engine still matches TensorFlow."""
    monkeypatch.setattr(cuda, "RUNTIME", CudaRuntime(NumpyStandIn()))
    pkg = zoo.package(name)
    target = resolve_target(Target("cuda", "NumPy-Stand-In", "fp32", BatchProfile(1, 4, 8)))
    meta = build_engine(pkg, open_package(pkg), target, tmp_path / "engine")
    coverage = meta["coverage"]
    assert set(coverage["ops"]["host"]) >= host_ops and not host_ops & set(coverage["ops"].get("cuda", {}))
    assert {op for seg in coverage["fallback_segments"] for op in seg["ops"]} >= host_ops
    assert all(seg["runtime"] == "host" for seg in coverage["fallback_segments"])
    model = load_model(pkg, "cuda", engine_dir=tmp_path / "engine")
    assert set(model._exe.plan.fallback_ops) >= host_ops
    graph, golden = load(pkg)
    check_all_batches(lambda feeds: list(model.predict(dict(zip([v.name for v in graph.inputs], feeds))).values()),
                      graph, golden, 1e-4)


def test_cuda_stand_in_engine_build_load_and_refusal_on_another_gpu(zoo, tmp_path, monkeypatch) -> None:
    """build_engine -> engine folder -> load_model(device='cuda') through the shared device API,
    with the cuda runtime's GPU boundary replaced by the NumPy stand-in."""
    backend = NumpyStandIn()
    monkeypatch.setattr(cuda, "RUNTIME", CudaRuntime(backend))
    pkg = zoo.package("mlp")
    out = tmp_path / "engine"
    target = resolve_target(Target("cuda", "NumPy-Stand-In", "fp32", BatchProfile(1, 4, 8)))
    meta = build_engine(pkg, open_package(pkg), target, out)
    assert (out / cuda.TUNING_FILE).is_file() and cuda.TUNING_FILE in meta["files"]
    assert meta["key"].startswith("cuda_numpy-stand-in_sm00_")
    model = load_model(pkg, "cuda", engine_dir=out)
    graph, golden = load(pkg)
    check_all_batches(lambda feeds: list(model.predict(dict(zip([v.name for v in graph.inputs], feeds))).values()), graph, golden, 1e-4)
    with pytest.raises(TargetError, match="engines must be built on the GPU model they serve on"):
        monkeypatch.setattr(backend, "identity", lambda: cuda.NodeIdentity("NVIDIA-A100-SXM4-40GB", "8.0", "x"))
        load_model(pkg, "cuda", engine_dir=out)
    monkeypatch.setattr(backend, "identity", lambda: cuda.NodeIdentity("NumPy-Stand-In", "9.0", meta["target"]["backend_version"]))
    with pytest.raises(TargetError, match="does not match this node"):
        load_model(pkg, "cuda", engine_dir=out)


@pytest.mark.parametrize("name,label", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
    ("Tesla T4", "Tesla-T4"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"),
    ("  NVIDIA  GeForce RTX 4090 ", "NVIDIA-GeForce-RTX-4090"),
])
def test_gpu_product_label_matches_gpu_feature_discovery(name: str, label: str) -> None:
    assert gfd_product(name) == label


POOL_CASES = [
    ("maxpool_ceil", dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), "MaxPool", (1, 2, 7, 7)),
    ("maxpool_pad", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), "MaxPool", (2, 3, 9, 9)),
    ("avgpool_excl_pad", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]), "AveragePool", (1, 2, 6, 6)),
    ("avgpool_incl_pad_ceil", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1, ceil_mode=1), "AveragePool", (1, 2, 8, 8)),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_cuda_pool_numpy_stand_in_matches_onnxruntime(case) -> None:  # type: ignore[no-untyped-def]
    """Device pooling shares its window geometry and divisor counts with the host kernel."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from onnx_cases import make_model, node, run_ort

    _, attrs, op, shape = case
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    expected = run_ort(make_model([node(op, ["x"], **attrs)], {"x": x}, ["y"]), {"x": x})[0]
    got = ops.call(op, x, device="cuda", ctx=ck.DeviceContext(xp=np), **attrs)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,bucket", [(1, 1), (2, 2), (3, 4), (33, 64), (64, 64), (65, 128)])
def test_cuda_graph_batch_bucket_is_the_next_power_of_two(rows: int, bucket: int) -> None:
    assert cuda.batch_bucket(rows) == bucket


def test_cuda_tuning_record_measured_on_another_gpu_product_is_refused(zoo, tmp_path) -> None:
    """The record holds what was fastest and accurate on one GPU product, as a TensorRT timing cache does."""
    graph, golden = load(zoo.package("small_cnn"))
    target = Target("cuda", "NumPy-Stand-In", "fp32", BatchProfile(1, 4, 4)).resolve("0.0", "x")
    options = STAND_IN.tune(fresh(graph), target, golden, repeats=1)
    record = json.loads(options["_files"][cuda.TUNING_FILE])
    assert record["gpu_product"] == "NumPy-Stand-In" and record["choice"]["math"] == "default"
    (tmp_path / cuda.TUNING_FILE).write_text(json.dumps(record))
    assert STAND_IN.prepare(fresh(graph), {"engine_dir": str(tmp_path)}).plan.ctx.conv_algo == record["choice"]["conv_algo"]
    (tmp_path / cuda.TUNING_FILE).write_text(json.dumps({**record, "gpu_product": "NVIDIA-A100-SXM4-80GB"}))
    with pytest.raises(TargetError, match="tuned on NVIDIA-A100-SXM4-80GB, and this node's GPU is NumPy-Stand-In"):
        STAND_IN.prepare(fresh(graph), {"engine_dir": str(tmp_path)})


class FakeCudnnAtTheBoundary:
    """cuDNN's place in the plan, NumPy behind it: layers convolve by their taps, and a choice is
    recorded where the plan's choices have none (what timing cudnnFind's best against the GEMM
    path would decide): here the GEMM path for 1x1 kernels, 'algorithm 1' for the others."""

    def __init__(self) -> None:
        self.searched: list[str] = []
        self.layers: list[tuple[tuple[int, ...], list[int], int]] = []

    def layer(self, w, pads, strides, dil, group, choices, key):  # type: ignore[no-untyped-def]
        self.layers.append((tuple(w.shape), list(pads), group))

        def run(x, oh, ow, gemm_path):  # type: ignore[no-untyped-def]
            name = f"{key} {'x'.join(map(str, x.shape))}"
            o, cg, kh, kw = w.shape
            if name not in choices:
                self.searched.append(name)
                choices[name] = cudnn.GEMM_PATH if kh == kw == 1 else 1
            if choices[name] == cudnn.GEMM_PATH:
                return gemm_path()
            xpad = ck._pad(np, x, pads, pads)
            y = np.zeros((x.shape[0], o, oh, ow), dtype=np.float64)
            og = o // group
            for g in range(group):
                for i in range(kh):
                    for j in range(kw):
                        tap = ck._tap(np, xpad[:, g * cg:(g + 1) * cg], i, j, strides, dil, oh, ow)
                        y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", tap, w[g * og:(g + 1) * og, :, i, j])
            return y.astype(x.dtype)

        return run


class StandInWithFakeCudnn(NumpyStandIn):
    def __init__(self) -> None:
        self.fake = FakeCudnnAtTheBoundary()

    def dnn(self, math_mode: str) -> FakeCudnnAtTheBoundary:
        return self.fake


def test_cudnn_conv_algo_is_refused_clearly_where_cudnn_cannot_load(zoo) -> None:
    graph, _ = load(zoo.package("small_cnn"))
    assert "cudnn" not in {c.conv_algo for c in STAND_IN.candidates("fp16")}
    with pytest.raises(cuda.DeviceUnavailableError, match="no cuDNN"):
        STAND_IN.prepare(graph, {"precision": "fp32", "conv_algo": "cudnn"})


def test_fake_cudnn_boundary_takes_every_convolution_and_records_its_choices(zoo, tmp_path) -> None:
    backend = StandInWithFakeCudnn()
    rt = CudaRuntime(backend)
    assert "cudnn" in {c.conv_algo for c in rt.candidates("fp32")}
    graph, golden = load(zoo.package("small_cnn"))
    exe = rt.prepare(fresh(graph), {"precision": "fp32", "conv_algo": "cudnn"})
    check_all_batches(exe.run, graph, golden, 1e-4)
    convs = [n for n in graph.nodes if n.op == "Conv"]
    assert len(backend.fake.layers) == len(convs) > 0
    choices = dict(exe.plan.ctx.conv_choices)
    assert len(choices) == len(convs) * len(golden) == len(backend.fake.searched)  # one search per layer and shape
    assert set(choices.values()) == {1, cudnn.GEMM_PATH}  # both paths ran, and the golden outputs still match
    # an engine tuned on this GPU replays its choices: no search the second time
    record = {"choice": {"precision": "fp32", "conv_algo": "cudnn", "cuda_graphs": False, "math": "default"},
              "gpu_product": "NumPy-Stand-In", "conv_choices": choices}
    (tmp_path / cuda.TUNING_FILE).write_text(json.dumps(record))
    backend.fake.searched.clear()
    again = rt.prepare(fresh(graph), {"engine_dir": str(tmp_path)})
    check_all_batches(again.run, graph, golden, 1e-4)
    assert backend.fake.searched == [] and again.plan.ctx.conv_choices == choices


def test_fake_cudnn_boundary_leaves_fused_depthwise_and_asymmetric_padding_to_the_native_kernels() -> None:
    """cuDNN's 2-D descriptor pads both sides alike; TF's 'same' stride-2 pads one more at the end."""
    backend = StandInWithFakeCudnn()
    rt = CudaRuntime(backend)
    x = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((6, 4, 3, 3)).astype(np.float32)
    asym = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])
    model = helper.make_model(helper.make_graph(
        [asym], "g", [helper.make_tensor_value_info("x", 1, [1, 4, 8, 8])], [helper.make_tensor_value_info("y", 1, None)],
        [helper.make_tensor("w", 1, w.shape, w.ravel())]), opset_imports=[helper.make_opsetid("", 17)])
    exe = rt.prepare(from_proto(model), {"precision": "fp32", "conv_algo": "cudnn"})
    y = exe.run([x])[0]
    assert backend.fake.layers == [] and y.shape == (1, 6, 4, 4)


def test_cuda_tune_times_candidates_at_the_targets_optimal_batch(zoo, monkeypatch) -> None:
    """Which convolution wins depends on the batch: candidates are timed at the profile's opt rows."""
    graph, golden = load(zoo.package("small_cnn"))
    seen: list[int] = []
    run = cuda.CudaExecutable.run

    def recording(self, feeds):  # type: ignore[no-untyped-def]
        seen.append(feeds[0].shape[0])
        return run(self, feeds)

    monkeypatch.setattr(cuda.CudaExecutable, "run", recording)
    target = Target("cuda", "NumPy-Stand-In", "fp32", BatchProfile(1, 16, 32)).resolve("0.0", "x")
    options = STAND_IN.tune(fresh(graph), target, golden, repeats=2)
    assert options["tuned_batch"] == 16 and 16 in seen and set(seen) - {16} == set(golden)


class BrokenFakeCudnnAtTheBoundary(FakeCudnnAtTheBoundary):
    def layer(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")


def test_fake_cudnn_boundary_failing_is_reported_and_another_candidate_chosen(zoo) -> None:
    class Broken(StandInWithFakeCudnn):
        def __init__(self) -> None:
            self.fake = BrokenFakeCudnnAtTheBoundary()

    graph, golden = load(zoo.package("small_cnn"))
    target = Target("cuda", "NumPy-Stand-In", "fp32", BatchProfile(1, 4, 4)).resolve("0.0", "x")
    options = CudaRuntime(Broken()).tune(fresh(graph), target, golden, repeats=1)
    assert "CUDNN_STATUS_NOT_SUPPORTED" in options["candidates"]["cudnn"]["error"]
    assert options["conv_algo"] in ("im2col", "shifted")
