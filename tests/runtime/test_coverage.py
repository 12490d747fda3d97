"""Where each node runs: the fallback chain (cuda -> host -> onnxruntime), its coverage report,
and the onnxruntime segments the host runtime runs for nodes it has no kernel for (onnxruntime
is the real one, installed here; `Det` stands for any op without a host kernel)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import make_model, node, run_ort

from kubetrt.runtime import coverage as cov_module
from kubetrt.runtime.coverage import describe, place, require_runnable
from kubetrt.runtime.devices.host import RUNTIME as HOST
from kubetrt.runtime.errors import UnsupportedOpError
from kubetrt.runtime.kernels.registry import lookup
from kubetrt.runtime.onnx_import import from_proto

NO_HOST_KERNEL = "Det"


def det_model() -> tuple[object, dict[str, np.ndarray]]:
    """relu -> Det (no host kernel) -> mul -> Erf: host, onnxruntime, host again."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 3)).astype(np.float32)
    nodes = [node("Relu", ["x"], ["r"]), node("Add", ["r", "eye"], ["a"]), node("Det", ["a"], ["d"]),
             node("Mul", ["d", "two"], ["m"]), node("Erf", ["m"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], {"eye": np.eye(3, dtype=np.float32), "two": np.float32(2.0)},
                       dynamic_batch=True)
    return model, {"x": x}


def test_no_host_kernel_for_the_stand_in_op() -> None:
    with pytest.raises(UnsupportedOpError):
        lookup(NO_HOST_KERNEL, "host")


def test_place_host_sends_only_the_missing_op_to_onnxruntime() -> None:
    graph = from_proto(det_model()[0])
    cov = place(graph, "host", allow=("onnxruntime",))
    assert cov.ops_per_runtime() == {"host": {"Add": 1, "Erf": 1, "Mul": 1, "Relu": 1}, "onnxruntime": {"Det": 1}}
    [segment] = cov.segments
    assert segment["runtime"] == "onnxruntime" and segment["ops"] == ["Det"] and segment["inputs"] == ["a"]
    assert cov.missing == []
    assert any("fallback segment" in line and "onnxruntime" in line for line in describe(cov.to_json()))


def test_without_permission_the_node_is_missing_and_named() -> None:
    graph = from_proto(det_model()[0])
    assert place(graph, "host").missing == ["det_d"]
    with pytest.raises(UnsupportedOpError, match=r"model det-test: .*det_d \(Det\).*--allow-fallback onnxruntime"):
        require_runnable(graph, "host", "det-test")


def test_place_cuda_falls_back_to_host_for_ops_without_cuda_kernel() -> None:
    x = np.ones((2, 4), np.float32)
    nodes = [node("Relu", ["x"], ["r"]), node("CumSum", ["r", "axis"], ["c"]), node("Tanh", ["c"], ["y"])]
    graph = from_proto(make_model(nodes, {"x": x}, ["y"], {"axis": np.array(1, np.int64)}))
    cov = place(graph, "cuda")
    assert cov.placement == {"relu_r": "cuda", "cumsum_c": "host", "tanh_y": "cuda"}
    assert [s["ops"] for s in cov.segments] == [["CumSum"]] and cov.segments[0]["runtime"] == "host"


def test_host_runtime_runs_onnxruntime_segments_between_host_segments() -> None:
    model, feeds = det_model()
    want = run_ort(model, feeds)[0]
    for batch in (5, 2):  # the batch stays dynamic across segment boundaries
        exe = HOST.prepare(from_proto(model), {})
        got = exe.run([feeds["x"][:batch]])[0]
        np.testing.assert_allclose(got, want[:batch], rtol=1e-5, atol=1e-6)
    assert [s.supported for s in exe.segments] == [True, False, True]  # type: ignore[union-attr]


def test_without_onnxruntime_the_load_fails_naming_node_and_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrt.runtime.devices import onnxruntime_fallback

    monkeypatch.setattr(onnxruntime_fallback, "onnxruntime_installed", lambda: False)
    with pytest.raises(UnsupportedOpError, match=r"det_d \(Det\).*kubetrt\[fallback\]"):
        HOST.prepare(from_proto(det_model()[0]), {})


def test_subgraph_node_runs_where_its_body_can() -> None:
    """A Loop whose body holds an op without a host kernel cannot run on the host."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Det", ["v_in"], ["d"]),
         helper.make_node("Identity", ["v_in"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [2, 2]),
         helper.make_tensor_value_info("d", TensorProto.FLOAT, [])],
    )
    loop = helper.make_node("Loop", ["n", "", "v"], ["v_last", "dets"], name="loop", body=body)
    model = make_model([loop], {"v": np.eye(2, dtype=np.float32)}, ["v_last", "dets"], {"n": np.array(3, np.int64)})
    graph = from_proto(model)
    assert not cov_module.has_kernel(graph.nodes[0], "host")
    assert place(graph, "host", allow=("onnxruntime",)).placement == {"loop": "onnxruntime"}
