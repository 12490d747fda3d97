"""Everything around the TensorRT calls, on machines without TensorRT: profile shapes, timing-cache
naming, which segments go to TensorRT, the missing-library errors, and the builder/runner control
flow against a FAKE `tensorrt` module that records calls (a fake of the TensorRT boundary: it
proves the documented call sequence is made, not that TensorRT accepts it)."""
from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
from helpers import load
from kubetrt.runtime.devices import available_devices, get_device
from kubetrt.runtime.devices import tensorrt as trt_rt
from kubetrt.runtime.errors import DeviceUnavailableError
from kubetrt.runtime.target import BatchProfile, Target


def test_profile_shapes_from_target_batch_range() -> None:
    shapes = trt_rt.profile_shapes({"image": (-1, 3, 32, 32), "ids": (2, 5)}, BatchProfile(1, 8, 64))
    assert shapes["image"] == ((1, 3, 32, 32), (8, 3, 32, 32), (64, 3, 32, 32))
    assert shapes["ids"] == ((2, 5),) * 3
    with pytest.raises(ValueError, match="only the batch dim may vary"):
        trt_rt.profile_shapes({"tokens": (-1, -1)}, BatchProfile())


def test_timing_cache_is_per_gpu_product_and_trt_version(tmp_path) -> None:
    a = trt_rt.timing_cache_path(tmp_path, "NVIDIA-H100-80GB-HBM3", "10.7.0")
    assert a == tmp_path / "NVIDIA-H100-80GB-HBM3_trt10.7.0.timing-cache"
    assert a != trt_rt.timing_cache_path(tmp_path, "NVIDIA-H100-80GB-HBM3", "11.0.0")
    assert a != trt_rt.timing_cache_path(tmp_path, "Tesla-T4", "10.7.0")


def test_strong_typing_from_trt_11() -> None:
    assert not trt_rt.strongly_typed("10.13.0.35") and trt_rt.strongly_typed("11.0.0")


def test_missing_tensorrt_is_reported_clearly(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    with pytest.raises(DeviceUnavailableError, match="tensorrt Python package is not installed .*NVIDIA's package index"):
        get_device("tensorrt").check_available()
    assert "tensorrt Python package is not installed" in (available_devices()["tensorrt"] or "")


def test_segment_plan_from_parser_report(zoo) -> None:
    graph, _ = load(zoo.package("small_cnn"))
    names = {n.name for n in graph.nodes if n.op != "GlobalAveragePool"}
    segs = trt_rt.plan_segments(graph, names)
    assert [(s.supported, len(s.nodes)) for s in segs] == [(True, 12), (False, 1), (True, 3)]
    # the default minimum segment size sends a 2-node TensorRT run to the fallback
    mlp, _ = load(zoo.package("mlp"))
    segs = trt_rt.plan_segments(mlp, {n.name for n in mlp.nodes if n.op != "Relu"})
    assert [s.supported for s in segs] == [False]


# ------------------------------------------------------------------ fake TensorRT boundary

class _Enum:
    def __init__(self, **kw: int) -> None:
        self.__dict__.update(kw)


def fake_trt(version: str, calls: list[tuple[Any, ...]], supported: set[int] | None = None) -> types.ModuleType:
    """A recording stand-in for the `tensorrt` module (TensorRT 10/11 Python API names)."""
    m = types.ModuleType("tensorrt")
    m.__version__ = version

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            calls.append(("Logger", level))

    class Parser:
        def __init__(self, network: Any, logger: Any) -> None:
            self.num_errors = 0

        def supports_model_v2(self, data: bytes) -> bool:
            calls.append(("supports_model_v2",))
            return supported is None

        @property
        def num_subgraphs(self) -> int:
            return 1

        def is_subgraph_supported(self, i: int) -> bool:
            return True

        def get_subgraph_nodes(self, i: int) -> list[int]:
            return sorted(supported or ())

        def parse(self, data: bytes) -> bool:
            calls.append(("parse", len(data) > 0))
            return True

    class Cache:
        def serialize(self) -> bytes:
            return b"cache-v2"

    class Config:
        def set_memory_pool_limit(self, pool: str, size: int) -> None:
            calls.append(("set_memory_pool_limit", pool, size))

        def set_flag(self, flag: str) -> None:
            calls.append(("set_flag", flag))

        def create_timing_cache(self, data: bytes) -> Cache:
            calls.append(("create_timing_cache", bytes(data)))
            return Cache()

        def set_timing_cache(self, cache: Cache, ignore_mismatch: bool) -> bool:
            calls.append(("set_timing_cache", ignore_mismatch))
            return True

        def add_optimization_profile(self, profile: Any) -> int:
            calls.append(("add_optimization_profile",))
            return 0

        def get_timing_cache(self) -> Cache:
            return Cache()

    class Profile:
        def set_shape(self, name: str, mn: tuple, opt: tuple, mx: tuple) -> None:
            calls.append(("set_shape", name, mn, opt, mx))

    class Builder:
        def __init__(self, logger: Any) -> None:
            pass

        def create_network(self, flags: int) -> object:
            calls.append(("create_network", flags))
            return object()

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Any, config: Any) -> bytes:
            calls.append(("build_serialized_network",))
            return b"PLAN"

    m.Logger, m.Builder, m.OnnxParser = Logger, Builder, Parser
    m.MemoryPoolType = _Enum(WORKSPACE="WORKSPACE")
    m.BuilderFlag = _Enum(FP16="FP16", INT8="INT8")
    m.NetworkDefinitionCreationFlag = _Enum(STRONGLY_TYPED=5)
    return m


def _names(calls: list[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in calls if c[0] != "Logger"]


@pytest.mark.parametrize("version,flags,fp16_flag", [("10.7.0", 0, True), ("11.0.0", 1 << 5, False)])
def test_fake_trt_boundary_builder_call_sequence(version: str, flags: int, fp16_flag: bool) -> None:
    calls: list[tuple[Any, ...]] = []
    trt = fake_trt(version, calls)
    shapes = {"image": ((1, 3, 8, 8), (4, 3, 8, 8), (16, 3, 8, 8))}
    plan, cache = trt_rt.build_plan(trt, b"onnx-bytes", shapes, "fp16", timing_cache=b"old-cache")
    assert (plan, cache) == (b"PLAN", b"cache-v2")
    expected = ["create_network", "parse", "set_memory_pool_limit"] + (["set_flag"] if fp16_flag else []) + [
        "create_timing_cache", "set_timing_cache", "set_shape", "add_optimization_profile", "build_serialized_network"]
    assert _names(calls) == expected
    assert ("create_network", flags) in calls and ("create_timing_cache", b"old-cache") in calls
    assert ("set_shape", "image", *shapes["image"]) in calls
    assert ("set_memory_pool_limit", "WORKSPACE", trt_rt.WORKSPACE_BYTES) in calls


def test_fake_trt_boundary_tune_builds_only_trt_segments(zoo, tmp_path, monkeypatch) -> None:
    graph, golden = load(zoo.package("small_cnn"))
    supported = {i for i, n in enumerate(graph.nodes) if n.op != "GlobalAveragePool"}
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt("11.1.0", calls, supported))
    monkeypatch.setenv("KUBETRT_TRT_CACHE", str(tmp_path))
    target = Target("tensorrt", "NVIDIA-H100-80GB-HBM3", "fp16", BatchProfile(1, 8, 32)).resolve("9.0", "trt11.1.0")
    options = trt_rt.RUNTIME.tune(graph, target, golden)
    files = options.pop("_files")
    assert sorted(files) == ["segment0.plan", "segment2.plan"] and set(files.values()) == {b"PLAN"}
    assert [s["supported"] for s in options["segments"]] == [True, False, True]
    assert options["strongly_typed"] and "set_flag" not in _names(calls)
    assert (tmp_path / "NVIDIA-H100-80GB-HBM3_trt11.1.0.timing-cache").read_bytes() == b"cache-v2"
    assert ("set_shape", "image", (1, 32, 32, 3), (8, 32, 32, 3), (32, 32, 32, 3)) in calls


@pytest.mark.parametrize("version, int8_flag", [("10.7.0", True), ("11.1.0", False)])
def test_fake_trt_boundary_int8_builds_the_qdq_model(zoo, tmp_path, monkeypatch, version: str, int8_flag: bool) -> None:
    """An int8 build hands TensorRT the explicitly quantized graph: Q/DQ nodes in what it parses;
    TensorRT 10 gets the INT8 builder flag, TensorRT 11 (strongly typed) no flag."""
    import onnx

    from kubetrt.pipeline.calibration import CalibrationOptions
    from kubetrt.pipeline.quantize import quantize
    from kubetrt.runtime.onnx_import import from_proto

    package = zoo.package("small_cnn")
    data = {"image": np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float32)}
    qdq = quantize(onnx.load(str(package / "model.onnx")), data, CalibrationOptions(source="synthetic", method="minmax")).model
    graph = from_proto(qdq)
    parsed: list[bytes] = []
    monkeypatch.setattr(trt_rt, "export_segment", lambda g, seg: _recording(_export(g, seg), parsed))
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt(version, calls, set(range(len(graph.nodes)))))
    monkeypatch.setenv("KUBETRT_TRT_CACHE", str(tmp_path))
    target = Target("tensorrt", "NVIDIA-H100-80GB-HBM3", "int8", BatchProfile(1, 8, 32)).resolve("9.0", f"trt{version}")
    options = trt_rt.RUNTIME.tune(graph, target, {})
    assert options["precision"] == "int8" and [s["supported"] for s in options["segments"]] == [True]
    assert (("set_flag", "INT8") in calls) == int8_flag and ("set_flag", "FP16") not in calls
    (segment,) = parsed
    ops = {n.op_type for n in segment.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops


_export = trt_rt.export_segment


def _recording(model: Any, into: list[Any]) -> Any:
    into.append(model)
    return model


def test_fake_trt_boundary_runner_uses_name_based_tensor_api() -> None:
    calls: list[tuple[Any, ...]] = []
    trt = types.SimpleNamespace(__version__="10.7.0")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    trt.TensorIOMode = _Enum(INPUT=0, OUTPUT=1)
    trt.nptype = lambda dt: np.float32

    class Context:
        def set_input_shape(self, name: str, shape: tuple) -> bool:
            calls.append(("set_input_shape", name, shape))
            return True

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            calls.append(("set_tensor_address", name, isinstance(ptr, int)))
            return True

        def get_tensor_shape(self, name: str) -> tuple:
            return (2, 10)

        def execute_async_v3(self, stream: int) -> bool:
            calls.append(("execute_async_v3", stream))
            return True

    class Engine:
        num_io_tensors = 2

        def get_tensor_name(self, i: int) -> str:
            return ["x", "y"][i]

        def get_tensor_mode(self, name: str) -> int:
            return 0 if name == "x" else 1

        def get_tensor_dtype(self, name: str) -> str:
            return "FLOAT"

        def create_execution_context(self) -> Context:
            return Context()

    trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda plan: Engine())

    class Stream:
        ptr = 1234

        def __init__(self, non_blocking: bool = False) -> None:
            pass

        def __enter__(self) -> Stream:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def synchronize(self) -> None:
            calls.append(("synchronize",))

    xp = types.SimpleNamespace(asarray=np.asarray, ascontiguousarray=np.ascontiguousarray, empty=np.empty,
                               cuda=types.SimpleNamespace(Stream=Stream))
    exe = trt_rt.TrtExecutable(trt, xp, b"PLAN", contexts=1)
    (y,) = exe.run([np.ones((2, 4), np.float32)])
    assert y.shape == (2, 10)
    assert calls == [("set_input_shape", "x", (2, 4)), ("set_tensor_address", "x", True),
                     ("set_tensor_address", "y", True), ("execute_async_v3", 1234), ("synchronize",)]


def test_tensorrt_prepare_needs_an_engine() -> None:
    with pytest.raises(ValueError, match="runs built engines only"):
        trt_rt.RUNTIME.prepare(None, {})  # type: ignore[arg-type]
