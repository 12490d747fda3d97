"""The `tensorrt` device runtime: ONNX segments -> TensorRT engines built on the serving GPU type.

Build (tune): the ONNX parser says which nodes it can take (supports_model_v2 +
get_subgraph_nodes); runtime.partition turns that into TensorRT segments and fallback segments
(TF-TRT style). Each TensorRT segment is exported to ONNX (float16-typed for strongly typed
TensorRT 11, BuilderFlag.FP16 on TensorRT 10), built with an optimization profile from the
target's batch range, reusing a timing cache kept per (GPU product, TensorRT version).
Run (prepare): deserialize_cuda_engine, a pool of execution contexts, set_input_shape /
set_tensor_address / execute_async_v3 on a CuPy stream. TensorRT 10/11 names only: no binding
indices, no execute_async_v2, no max_workspace_size.
"""
from __future__ import annotations

import importlib
import os
import queue
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DeviceUnavailableError
from ..graph import Graph
from ..package import PackageError
from ..partition import (
    Segment,
    SegmentRunner,
    export_segment,
    partition,
    segment_graph,
)
from ..onnx_export import graph_to_onnx
from ..target import BatchProfile, Target
from . import NodeIdentity

TRT_MISSING = ("the tensorrt Python package is not installed "
               "(it comes from NVIDIA's package index on GPU node images)")
WORKSPACE_BYTES = 4 << 30
MIN_SEGMENT_SIZE = 3
SEGMENTS_KEY = "segments"


def import_trt() -> Any:
    try:
        return importlib.import_module("tensorrt")
    except ImportError as e:
        raise DeviceUnavailableError(TRT_MISSING) from e


def trt_major(version: str) -> int:
    return int(version.split(".")[0])


def strongly_typed(version: str) -> bool:
    """TensorRT 11 dropped the FP16/INT8 builder flags: precision is in the network's types."""
    return trt_major(version) >= 11


def profile_shapes(inputs: dict[str, tuple[int, ...] | None], profile: BatchProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes per input: the batch dim (dim 0, dynamic) from the target's profile.

    Any other dynamic dim cannot be given a range from a batch profile, so it is an error.
    """
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for name, shape in inputs.items():
        if shape is None or not shape:
            raise ValueError(f"input {name!r}: TensorRT needs a known rank for an optimization profile")
        rest = tuple(shape[1:])
        if any(d < 0 for d in rest):
            raise ValueError(f"input {name!r} has dynamic non-batch dims {list(shape)}; only the batch dim may vary")
        if shape[0] >= 0:  # a fixed batch dim stays fixed
            out[name] = ((shape[0],) + rest,) * 3
        else:
            out[name] = tuple((b,) + rest for b in (profile.min, profile.opt, profile.max))
    return out


def timing_cache_path(root: str | os.PathLike[str], gpu_product: str, trt_version: str) -> Path:
    """One timing cache per (GPU product, TensorRT version): tactics timed on one never mislead another."""
    safe = lambda s: re.sub(r"[^A-Za-z0-9._-]", "-", s)
    return Path(root) / f"{safe(gpu_product)}_trt{safe(trt_version)}.timing-cache"


def default_cache_root() -> Path:
    return Path(os.environ.get("KUBETRT_TRT_CACHE", Path.home() / ".cache" / "kubetrt" / "tensorrt"))


def supported_node_names(trt: Any, graph: Graph, model_bytes: bytes) -> set[str]:
    """Names of the nodes the ONNX parser can take, from supports_model_v2's subgraph report."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if parser.supports_model_v2(model_bytes):
        return {n.name for n in graph.nodes}
    names: set[str] = set()
    for i in range(parser.num_subgraphs):
        if parser.is_subgraph_supported(i):
            names.update(graph.nodes[j].name for j in parser.get_subgraph_nodes(i))
    return names


def _network_flags(trt: Any) -> int:
    if strongly_typed(trt.__version__):
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return 0  # TensorRT 10: explicit batch is the only mode, no flag needed


def build_plan(trt: Any, model_bytes: bytes, shapes: dict[str, tuple[tuple[int, ...], ...]], precision: str,
               timing_cache: bytes = b"", workspace: int = WORKSPACE_BYTES) -> tuple[bytes, bytes]:
    """Serialized engine and updated timing cache for one ONNX model (or segment)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT's ONNX parser rejected the segment: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    if not strongly_typed(trt.__version__):  # TensorRT 10 still takes precision from builder flags
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif precision == "int8":  # the network's Q/DQ nodes say where; the flag allows int8 kernels
            config.set_flag(trt.BuilderFlag.INT8)
    cache = config.create_timing_cache(timing_cache)
    config.set_timing_cache(cache, False)
    profile = builder.create_optimization_profile()
    for name, (mn, opt, mx) in shapes.items():
        profile.set_shape(name, mn, opt, mx)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine (see the TensorRT log above)")
    return bytes(serialized), bytes(config.get_timing_cache().serialize())


def plan_segments(graph: Graph, trt_nodes: set[str], min_segment_size: int = MIN_SEGMENT_SIZE) -> list[Segment]:
    """The segments a build makes from the parser's report; prepare recomputes and checks them."""
    return partition(graph, lambda n: n.name in trt_nodes, min_segment_size)


def segment_file(seg: Segment, whole: bool) -> str:
    return "engine.plan" if whole else f"segment{seg.index}.plan"


def _ptr(a: Any) -> int:
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # a CuPy array's device pointer
    return int(ptr) if ptr is not None else int(a.ctypes.data)


class TrtExecutable:
    """One engine with a pool of execution contexts; NumPy in, NumPy out, on CuPy streams."""

    def __init__(self, trt: Any, xp: Any, plan: bytes, contexts: int = 2) -> None:
        self.trt, self.xp = trt, xp
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise PackageError("TensorRT could not deserialize the engine plan (built by another TensorRT version?)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self._pool: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        for _ in range(max(1, contexts)):
            self._pool.put((self.engine.create_execution_context(), xp.cuda.Stream(non_blocking=True)))

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        ctx, stream = self._pool.get()
        try:
            with stream:
                keep = []
                for name, x in zip(self.inputs, feeds):
                    d = self.xp.ascontiguousarray(self.xp.asarray(x, dtype=self.dtypes[name]))
                    keep.append(d)
                    ctx.set_input_shape(name, tuple(d.shape))
                    ctx.set_tensor_address(name, _ptr(d))
                outs = []
                for name in self.outputs:
                    out = self.xp.empty(tuple(ctx.get_tensor_shape(name)), dtype=self.dtypes[name])
                    outs.append(out)
                    ctx.set_tensor_address(name, _ptr(out))
                if not ctx.execute_async_v3(stream.ptr):
                    raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
                stream.synchronize()
                return [o.get() if hasattr(o, "get") else np.asarray(o) for o in outs]
        finally:
            self._pool.put((ctx, stream))


class TensorRTRuntime:
    name = "tensorrt"

    def check_available(self) -> None:
        trt = import_trt()
        from .cuda import RUNTIME as CUDA

        try:
            CUDA.check_available()
        except DeviceUnavailableError as e:
            raise DeviceUnavailableError(f"tensorrt {trt.__version__} is installed, but its buffers and streams need cupy: {e}") from e

    def identity(self) -> NodeIdentity:
        self.check_available()
        from .cuda import RUNTIME as CUDA

        cuda = CUDA.identity()
        return NodeIdentity(cuda.gpu_product, cuda.compute_capability, f"trt{import_trt().__version__}")

    def tune(self, graph: Graph, target: Target, golden: dict[int, Any]) -> dict[str, Any]:
        """Build engines for the TensorRT segments; fallback segments are recorded, not built.
        For int8 the graph is the package's Q/DQ model (explicit quantization: TensorRT 11 has no
        calibrators, the pipeline calibrated it)."""
        trt = import_trt()
        model_bytes = graph_to_onnx(graph).SerializeToString()
        segs = plan_segments(graph, supported_node_names(trt, graph, model_bytes))
        whole = len(segs) == 1 and segs[0].supported
        cache_path = timing_cache_path(default_cache_root(), target.gpu_product, trt.__version__)
        cache = cache_path.read_bytes() if cache_path.is_file() else b""
        files: dict[str, bytes] = {}
        records = []
        for seg in segs:
            rec = seg.to_json()
            if seg.supported:
                onnx_model = export_segment(graph, seg)
                if target.precision == "fp16" and strongly_typed(trt.__version__):
                    from ..fp16 import to_float16

                    onnx_model = to_float16(onnx_model)
                shapes = profile_shapes({v.name: _dims(v) for v in onnx_model.graph.input}, target.profile)
                plan, cache = build_plan(trt, onnx_model.SerializeToString(), shapes, target.precision, cache)
                rec["plan"] = segment_file(seg, whole)
                files[rec["plan"]] = plan
            records.append(rec)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_bytes(cache)
        return {"precision": target.precision, "strongly_typed": strongly_typed(trt.__version__),
                "min_segment_size": MIN_SEGMENT_SIZE, SEGMENTS_KEY: records,
                "timing_cache": cache_path.name, "_files": files}

    def prepare(self, graph: Graph, options: dict[str, Any]) -> SegmentRunner:
        engine_dir = options.get("engine_dir")
        records = options.get(SEGMENTS_KEY)
        if not engine_dir or records is None:
            raise ValueError("the tensorrt runtime runs built engines only: load the model with engine_dir=<engine folder>")
        self.check_available()
        trt = import_trt()
        from .cuda import RUNTIME as CUDA

        trt_nodes = {name for r in records if r["supported"] for name in r["nodes"]}
        segs = plan_segments(graph, trt_nodes, int(options.get("min_segment_size", MIN_SEGMENT_SIZE)))
        if [s.to_json() for s in segs] != [{k: v for k, v in r.items() if k != "plan"} for r in records]:
            raise PackageError(f"{engine_dir}: the engine's segments do not match this model's graph; rebuild the engine")
        fallback = options.get("fallback", "host")
        exes: list[Any] = []
        for seg, rec in zip(segs, records):
            if seg.supported:
                exes.append(TrtExecutable(trt, CUDA.backend.xp, (Path(engine_dir) / rec["plan"]).read_bytes()))
            else:
                from . import get_device

                exes.append(get_device(fallback).prepare(segment_graph(graph, seg), {}))
        return SegmentRunner(graph, segs, exes)


def _dims(vi: Any) -> tuple[int, ...] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)


RUNTIME = TensorRTRuntime()
