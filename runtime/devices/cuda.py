"""The `cuda` device runtime: CuPy kernels on a stream per execution context, with the whole
program captured as a CUDA Graph per input shape so batch-1 latency is not Python dispatch.

Layers, so that everything but the GPU boundary runs in CI with NumPy standing in for CuPy:
- DevicePlan: the compiled program with a residency decision per value (device data vs. host
  shape arithmetic), uploads of constants once, and the registry's kernels of device "cuda"
  (kernels/cuda.py).
- Backend: the array module plus what only a GPU has (streams, graph capture, fused epilogues,
  identity). CupyBackend is the real one; NumpyStandIn is the stand-in used by tests.
- CudaExecutable: a pool of execution contexts (stream + captured graphs + static buffers).
- CudaRuntime: check_available / identity / tune (choices per GPU type) / prepare.
"""
from __future__ import annotations

import contextlib
import copy
import json
import queue
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..accuracy import compare, device_class, tolerance_for
from ..errors import DeviceUnavailableError, KernelError, UnsupportedOpError
from ..executor import SequentialPlan
from ..graph import Graph
from ..kernels import cuda as ck
from ..kernels.activations import cuda_expr
from ..kernels.registry import KernelDef, lookup, op_def
from ..passes.shape_inference import spec_for
from ..program import compile_graph
from ..target import Target, TargetError
from ..timing import median_seconds
from . import NodeIdentity
from .cuda_native import MATH_MODES

TUNING_FILE = "cuda_tuning.json"
CUPY_MISSING = "cupy is not installed (pip install kubetrt[gpu])"
DTYPES: dict[str, np.dtype] = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}


def rows_of(x: np.ndarray, rows: int) -> np.ndarray:
    """`x`'s leading rows repeated to `rows` rows (a batch to time at, from a smaller one)."""
    return x if x.shape[0] == rows else np.resize(x, (rows, *x.shape[1:]))


def batch_bucket(rows: int) -> int:
    """The batch size whose captured graph serves `rows`: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


class CaptureUnsafe(RuntimeError):
    """The program cannot be captured as a CUDA Graph (a transfer, a host step, or anything the
    capture refused); that input signature runs eagerly."""


def gfd_product(name: str) -> str:
    """A CUDA device name as GPU Feature Discovery labels it: 'NVIDIA H100 80GB HBM3' ->
    'NVIDIA-H100-80GB-HBM3' (whitespace to '-', only label-safe characters, at most 63)."""
    label = re.sub(r"[^A-Za-z0-9._-]", "", re.sub(r"\s+", "-", name.strip()))
    return label[:63].strip("-._") or "unknown-gpu"


# ============================================================================ plan

@dataclass
class _Step:
    name: str
    op: str
    kind: str  # "host": host kernel on host values; "device": xp kernel; "fallback": host kernel on downloaded device values
    run: Callable[..., tuple[Any, ...]]
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    frees: tuple[int, ...]
    upload: frozenset[int] = frozenset()  # operand positions: host value -> device
    download: frozenset[int] = frozenset()  # operand positions: device value -> host
    skip: frozenset[int] = frozenset()  # operand positions the kernel holds itself (constants)


def _device_kernel(op: str, node: str) -> KernelDef | None:
    """The registry's cuda kernel for `op`; None where it has none (the plan runs the host kernel)."""
    try:
        return lookup(op, ck.DEVICE, node=node)
    except UnsupportedOpError:
        return None


class DevicePlan:
    """A Program whose values live on the device, except shape arithmetic, which stays on the host.

    Residency: graph inputs are device values; constants are host values (uploaded once where a
    device kernel reads them as data); Shape/Size outputs and the outputs of kernels whose data
    operands are all host values are host values; everything else is a device value. Host
    values are functions of the input shapes only, so their uploads are cached per value and
    content, which is what lets a CUDA Graph capture replay without any transfer.
    """

    def __init__(self, graph: Graph, ctx: ck.DeviceContext, to_host: Callable[[Any], np.ndarray]) -> None:
        self.ctx = ctx
        self.to_host = to_host
        # device kernels are NCHW: cuBLAS over channels-first; sub-graphs (If, Loop, Scan) run as host fallback steps
        prog = compile_graph(graph, "host", layout=False, subgraph_plan=SequentialPlan)
        self.prog = prog
        node_by_name = {n.name: n for n in graph.nodes}
        on_host = [v.const is not None for v in prog.values]
        self.steps: list[_Step] = []
        self.fallback_ops: list[str] = []
        self.sync_reasons: list[str] = []
        self.dev_consts: dict[int, Any] = {}
        for k in prog.kernels:
            op = op_def(k.op, node=k.name)
            data = [i for i, vid in enumerate(k.inputs) if vid >= 0 and i not in op.params]
            device_params = frozenset(i for i, vid in enumerate(k.inputs) if vid >= 0 and i in op.params and not on_host[vid])
            if op.shape_only or all(on_host[k.inputs[i]] for i in data) and not device_params:
                step = _Step(k.name, k.op, "host", k.run, tuple(k.inputs), tuple(k.outputs), tuple(k.frees))
                out_host = True
            elif (kernel := _device_kernel(k.op, k.name)) is not None:
                spec = replace(spec_for(graph, node_by_name[k.name], inplace=k.inplace), ctx=ctx)
                own = frozenset(i for i in kernel.own_consts if spec.const(i) is not None)
                upload = frozenset(i for i in data if on_host[k.inputs[i]] and i not in own)
                step = _Step(k.name, k.op, "device", kernel.factory(spec), tuple(k.inputs), tuple(k.outputs),
                             tuple(k.frees), upload, device_params, own)
                out_host = False
                if device_params:
                    self.sync_reasons.append(f"{k.op} {k.name} reads a device-computed shape parameter")
            else:  # no device kernel: run the host kernel between a download and an upload
                download = frozenset(i for i, vid in enumerate(k.inputs) if vid >= 0 and not on_host[vid])
                step = _Step(k.name, k.op, "fallback", k.run, tuple(k.inputs), tuple(k.outputs), tuple(k.frees), download=download)
                out_host = False
                self.fallback_ops.append(k.op)
                self.sync_reasons.append(f"{k.op} {k.name} has no device kernel and runs on the host")
            for vid in k.outputs:
                if vid >= 0:
                    on_host[vid] = out_host
            for i in step.upload:
                vid = k.inputs[i]
                if prog.values[vid].const is not None and vid not in self.dev_consts:
                    self.dev_consts[vid] = ctx.upload(prog.values[vid].const)
            self.steps.append(step)
        self.on_host = on_host
        self.template: list[Any] = [v.const for v in prog.values]
        self.out_dtypes = [np.dtype(o.dtype) if o.dtype is not None else None for o in graph.outputs]
        self._uploads: dict[tuple[Any, ...], Any] = {}

    @property
    def capturable(self) -> bool:
        """No step needs the host to wait for the device: the run can be one CUDA Graph."""
        return not self.sync_reasons

    def _upload(self, vid: int, x: Any, capturing: bool) -> Any:
        if vid in self.dev_consts:
            return self.dev_consts[vid]
        a = np.asarray(x)
        key = (vid, a.dtype.str, a.shape, a.tobytes())
        hit = self._uploads.get(key)
        if hit is None:
            if capturing:
                raise CaptureUnsafe(f"value {self.prog.values[vid].name} would be uploaded during capture")
            hit = self._uploads[key] = self.ctx.upload(a)
        return hit

    def run_device(self, feeds: list[Any], capturing: bool = False) -> list[Any]:
        """Device (or host) values in, device values out; float outputs in their declared dtype."""
        xp = self.ctx.xp
        slots = list(self.template)
        for vid, x in zip(self.prog.inputs, feeds):
            slots[vid] = x.astype(self.ctx.compute_dtype) if x.dtype.kind == "f" and x.dtype != self.ctx.compute_dtype else x
        for st in self.steps:
            args: list[Any] = []
            for i, vid in enumerate(st.ins):
                if vid < 0 or i in st.skip:
                    args.append(None)
                elif i in st.upload:
                    args.append(self._upload(vid, slots[vid], capturing))
                elif i in st.download:
                    if capturing:
                        raise CaptureUnsafe(f"{st.op} {st.name} reads a device value on the host")
                    args.append(self.to_host(slots[vid]))
                else:
                    args.append(slots[vid])
            try:
                results = st.run(*args)
            except CaptureUnsafe:
                raise
            except Exception as e:
                raise KernelError(f"kernel {st.op} (node {st.name}) failed on the cuda device: {type(e).__name__}: {e}") from e
            for vid, r in zip(st.outs, results):
                if vid >= 0:
                    slots[vid] = self.ctx.upload(r) if st.kind == "fallback" else r
            for vid in st.frees:
                slots[vid] = None
        outs = []
        for vid, dt in zip(self.prog.outputs, self.out_dtypes):
            v = slots[vid]
            if not self.on_host[vid] and dt is not None and v.dtype != dt:
                v = v.astype(dt)
            outs.append(v if not self.on_host[vid] else xp.asarray(v))
        return outs


# ============================================================================ backends

class NumpyStandIn:
    """NumPy in CuPy's place: a fake at the GPU boundary (no streams, no graphs), for CI."""

    name = "numpy-stand-in"
    xp = np
    can_capture = False

    def check_available(self) -> None:
        return None

    def identity(self) -> NodeIdentity:
        return NodeIdentity("NumPy-Stand-In", "0.0", f"numpy{np.__version__}-standin")

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def new_stream(self) -> Any:
        return None

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        yield

    def fused_epilogue(self) -> Callable[..., Any] | None:
        return None

    def gemm(self, math_mode: str) -> Callable[[Any, Any], Any] | None:
        return None

    def native(self) -> Any:
        return None

    def dnn(self, math_mode: str) -> Any:
        raise DeviceUnavailableError("the NumPy stand-in has no cuDNN")

    def synchronize(self) -> None:
        return None


class CupyBackend:
    """The real GPU boundary: CuPy arrays, streams, CUDA Graph capture, ElementwiseKernel epilogues."""

    name = "cupy"
    can_capture = True

    def __init__(self) -> None:
        self._cp: Any = None
        self._cublas: dict[str, Any] = {}
        self._native: Any = None
        self._dnn: dict[str, Any] = {}

    @property
    def xp(self) -> Any:
        if self._cp is None:
            self.check_available()
        return self._cp

    def check_available(self) -> None:
        if self._cp is not None:
            return
        try:
            import cupy
        except ImportError as e:
            raise DeviceUnavailableError(CUPY_MISSING) from e
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            raise DeviceUnavailableError(f"cupy {cupy.__version__} is installed but sees no CUDA GPU ({e})") from e
        if count < 1:
            raise DeviceUnavailableError(f"cupy {cupy.__version__} is installed but sees no CUDA GPU")
        self._cp = cupy

    def identity(self) -> NodeIdentity:
        cp = self.xp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        rt = cp.cuda.runtime.runtimeGetVersion()
        return NodeIdentity(gfd_product(name), f"{props['major']}.{props['minor']}",
                            f"cupy{cp.__version__}-cuda{rt // 1000}.{(rt % 1000) // 10}")

    def to_host(self, a: Any) -> np.ndarray:
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def new_stream(self) -> Any:
        return self.xp.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        with stream:
            yield

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def gemm(self, math_mode: str) -> Callable[[Any, Any], Any]:
        """cuBLAS on a handle per stream, which CUDA Graph capture may record (CuPy's may not)."""
        from .cuda_native import Cublas

        if math_mode not in self._cublas:
            self._cublas[math_mode] = Cublas(self.xp, math_mode)
        return self._cublas[math_mode].matmul

    def native(self) -> Any:
        from .cuda_native import NativeKernels

        if self._native is None:
            self._native = NativeKernels(self.xp)
        return self._native

    def dnn(self, math_mode: str) -> Any:
        """cuDNN for the `cudnn` conv algorithm; DeviceUnavailableError where it cannot load."""
        from .cudnn import Cudnn

        if math_mode not in self._dnn:
            try:
                self._dnn[math_mode] = Cudnn(self.xp, math_mode)
            except (OSError, AttributeError) as e:  # no libcudnn, or one without the legacy convolution API
                raise DeviceUnavailableError(f"cuDNN is not usable here ({e}); pip install nvidia-cudnn-cu13 "
                                             "(or -cu12), or use conv_algo im2col") from e
        return self._dnn[math_mode]

    def fused_epilogue(self) -> Callable[..., Any]:
        cp = self.xp
        cache: dict[str, Any] = {}

        def build(act: tuple[str, dict[str, Any]] | None) -> Callable[[Any, Any, Any], Any] | None:
            expr = cuda_expr(act)
            if expr is None:
                return None
            kern = cache.get(expr)
            if kern is None:
                kern = cache[expr] = cp.ElementwiseKernel(
                    "T b, T r", "T y", f"float v = (float)y + (float)b + (float)r; y = (T)({expr});",
                    f"kubetrt_epilogue_{len(cache)}")

            def run(y: Any, bias: Any, residual: Any) -> Any:
                zero = y.dtype.type(0)
                kern(zero if bias is None else bias, zero if residual is None else residual, y)
                return y

            return run

        return build

    def capture(self, stream: Any, plan: DevicePlan, feeds: list[np.ndarray]) -> _Captured:
        """Warm up on a private memory pool, then record the whole program as one CUDA Graph.

        The pool belongs to the graph: blocks freed during capture are reused only in capture
        order, and nobody else can take the addresses the replays write to.
        """
        cp = self.xp
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc), stream:
            bufs = [cp.empty(f.shape, f.dtype) for f in feeds]
            for b, f in zip(bufs, feeds):
                b[...] = cp.asarray(f)
            plan.run_device(bufs)  # cuBLAS handles and workspaces, pool blocks, cached uploads, compiled kernels
            stream.synchronize()
            stream.begin_capture()
            failure: Exception | None = None
            try:
                outs = plan.run_device(bufs, capturing=True)
            except Exception as e:  # anything the capture refuses: this signature runs eagerly
                failure = e
            try:
                graph = stream.end_capture()
            except Exception as e:
                failure = failure or e
            if failure is not None:
                stream.synchronize()
                raise CaptureUnsafe(f"{type(failure).__name__}: {failure}") from failure
        return _Captured(graph, bufs, outs, pool)


@dataclass
class _Captured:
    graph: Any
    inputs: list[Any]
    outputs: list[Any]
    pool: Any


@dataclass
class _Context:
    """One execution context: a stream and the graphs captured on it, per input signature."""

    stream: Any
    graphs: dict[tuple[Any, ...], _Captured] = field(default_factory=dict)
    eager: set[tuple[Any, ...]] = field(default_factory=set)


class CudaExecutable:
    """Runs a DevicePlan: replays a captured graph where possible, else dispatches kernel by kernel."""

    def __init__(self, plan: DevicePlan, backend: Any, cuda_graphs: bool = True, contexts: int = 2) -> None:
        self.plan = plan
        self.backend = backend
        self.cuda_graphs = bool(cuda_graphs and backend.can_capture and plan.capturable)
        self._pool: queue.SimpleQueue[_Context] = queue.SimpleQueue()
        for _ in range(max(1, contexts)):
            self._pool.put(_Context(backend.new_stream()))
        self.stats = {"captures": 0, "replays": 0, "eager_runs": 0}
        self.capture_failures: dict[tuple[Any, ...], str] = {}  # input signature -> why it runs eagerly
        # rows are independent where every input and output has a dynamic leading (batch) dimension
        ends = [plan.prog.values[v] for v in (*plan.prog.inputs, *plan.prog.outputs)]
        self.batch_rows = all(v.shape is not None and len(v.shape) > 0 and v.shape[0] == -1 for v in ends)
        self._stats_lock = threading.Lock()

    def _rows(self, feeds: list[np.ndarray]) -> int | None:
        """The batch to pad up to its bucket, or None: graphs are captured per bucket of batch sizes
        (as TensorRT profiles are), not per size, so a batching server does not capture up to
        max-batch-size graphs per context, each holding its own memory."""
        if not (self.cuda_graphs and self.batch_rows and feeds) or any(f.ndim == 0 for f in feeds):
            return None
        rows = feeds[0].shape[0]
        if rows == 0 or any(f.shape[0] != rows for f in feeds) or batch_bucket(rows) == rows:
            return None
        return int(rows)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        ctx = self._pool.get()
        try:
            with self.backend.on(ctx.stream):
                rows = self._rows(feeds)
                if rows is not None:  # replay the graph of the bucket, on zero-padded rows
                    feeds = [np.concatenate([f, np.zeros((batch_bucket(rows) - rows, *f.shape[1:]), f.dtype)])
                             for f in feeds]
                key = tuple((f.shape, f.dtype.str) for f in feeds)
                cap = self._graph_for(ctx, key, feeds) if self.cuda_graphs else None
                if cap is not None:
                    for buf, f in zip(cap.inputs, feeds):
                        buf.set(f)
                    cap.graph.launch(ctx.stream)
                    self._count("replays")
                    return [self.backend.to_host(o if rows is None else o[:rows]) for o in cap.outputs]
                xp = self.backend.xp
                outs = self.plan.run_device([xp.asarray(f) for f in feeds])
                self._count("eager_runs")
                return [self.backend.to_host(o if rows is None else o[:rows]) for o in outs]
        finally:
            self._pool.put(ctx)

    @property
    def streams(self) -> list[Any]:
        """The contexts' streams (for CUDA-event timing in benchmarks)."""
        ctxs = [self._pool.get() for _ in range(self._pool.qsize())]
        for c in ctxs:
            self._pool.put(c)
        return [c.stream for c in ctxs]

    def run_device(self, feeds: list[Any]) -> list[Any]:
        """Device arrays in and out, no host copies: for device-to-device chaining and benchmarks.
        With CUDA Graphs the outputs are the graph's buffers, valid until the context's next run."""
        ctx = self._pool.get()
        try:
            with self.backend.on(ctx.stream):
                key = tuple((tuple(f.shape), np.dtype(f.dtype).str) for f in feeds)
                cap = self._graph_for(ctx, key, feeds) if self.cuda_graphs else None
                if cap is not None:
                    for buf, f in zip(cap.inputs, feeds):
                        buf[...] = f
                    cap.graph.launch(ctx.stream)
                    return list(cap.outputs)
                return self.plan.run_device(list(feeds))
        finally:
            self._pool.put(ctx)

    def _graph_for(self, ctx: _Context, key: tuple[Any, ...], feeds: list[np.ndarray]) -> _Captured | None:
        cap = ctx.graphs.get(key)
        if cap is None and key not in ctx.eager:
            try:
                cap = ctx.graphs[key] = self.backend.capture(ctx.stream, self.plan, feeds)
                self._count("captures")
            except CaptureUnsafe as e:
                ctx.eager.add(key)
                self.capture_failures[key] = str(e)
        return cap


# ============================================================================ runtime

@dataclass(frozen=True)
class Choice:
    conv_algo: str
    cuda_graphs: bool
    math: str = "default"

    def label(self) -> str:
        return f"{self.conv_algo}{'+graphs' if self.cuda_graphs else ''}{'+' + self.math if self.math != 'default' else ''}"


class CudaRuntime:
    name = "cuda"

    def __init__(self, backend: Any | None = None) -> None:
        self.backend = backend if backend is not None else CupyBackend()

    def check_available(self) -> None:
        self.backend.check_available()

    def identity(self) -> NodeIdentity:
        self.check_available()
        return self.backend.identity()

    def build_plan(self, graph: Graph, precision: str = "fp32", conv_algo: str = "im2col",
                   math: str = "default", conv_choices: dict[str, int] | None = None) -> DevicePlan:
        if precision not in DTYPES:
            raise ValueError(f"cuda runtime precision {precision!r}: expected fp32 or fp16 (int8 needs TensorRT)")
        if conv_algo not in ck.CONV_ALGOS:
            raise ValueError(f"conv algorithm {conv_algo!r}: expected one of {', '.join(ck.CONV_ALGOS)}")
        if math not in MATH_MODES:
            raise ValueError(f"cuda math mode {math!r}: expected one of {', '.join(MATH_MODES)}")
        ctx = ck.DeviceContext(self.backend.xp, DTYPES[precision], conv_algo, self.backend.fused_epilogue(),
                               self.backend.gemm(math), self.backend.native(),
                               self.backend.dnn(math) if conv_algo == "cudnn" else None, dict(conv_choices or {}))
        return DevicePlan(graph, ctx, self.backend.to_host)

    def prepare(self, graph: Graph, options: dict[str, Any]) -> CudaExecutable:
        """Options come from engine.json; an engine folder's cuda_tuning.json, if any, is authoritative."""
        self.check_available()
        opts = dict(options)
        engine_dir = opts.get("engine_dir")
        if engine_dir and (Path(engine_dir) / TUNING_FILE).is_file():
            tuning = self._tuning_for_this_gpu(Path(engine_dir) / TUNING_FILE)
            opts.update(tuning["choice"], conv_choices=tuning.get("conv_choices", {}))
        plan = self.build_plan(graph, opts.get("precision", "fp32"), opts.get("conv_algo", "im2col"),
                               opts.get("math", "default"), opts.get("conv_choices"))
        return CudaExecutable(plan, self.backend, bool(opts.get("cuda_graphs", True)), int(opts.get("contexts", 2)))

    def _tuning_for_this_gpu(self, path: Path) -> dict[str, Any]:
        """The tuning record, refused where it was measured on another GPU product (as a TensorRT
        timing cache is): its choices are only known to be fastest and accurate there."""
        tuning: dict[str, Any] = json.loads(path.read_text())
        recorded, here = tuning.get("gpu_product"), self.identity().gpu_product
        if recorded is not None and recorded != here:
            raise TargetError(f"{path}: tuned on {recorded}, and this node's GPU is {here}; "
                              "rebuild the engine on this GPU type")
        return tuning

    def candidates(self, precision: str = "fp32") -> list[Choice]:
        graphs = (True, False) if self.backend.can_capture else (False,)
        maths = MATH_MODES if precision == "fp32" and self.backend.can_capture else ("default",)
        return [Choice(a, g, m) for a in self.conv_algos() for g in graphs for m in maths]

    def conv_algos(self) -> list[str]:
        """The conv algorithms this node can run: cudnn only where cuDNN loads."""
        try:
            self.backend.dnn("default")
        except DeviceUnavailableError:
            return [a for a in ck.CONV_ALGOS if a != "cudnn"]
        return list(ck.CONV_ALGOS)

    def tune(self, graph: Graph, target: Target, golden: dict[int, Any], repeats: int = 10) -> dict[str, Any]:
        """Time every candidate on this GPU at the target's optimal batch (the golden rows repeated;
        which convolution wins depends on the batch); keep the fastest one whose outputs match
        TensorFlow's golden outputs at the tolerance verification will hold it to."""
        self.check_available()
        precision = target.precision
        if precision not in DTYPES:
            raise ValueError(f"cuda runtime precision {precision!r}: expected fp32 or fp16 (int8 needs TensorRT)")
        tol = tolerance_for(precision, device_class(target.backend))
        if not golden:
            raise ValueError("tuning needs golden inputs and outputs; the package has none")
        largest = max(golden)
        dynamic = all(v.shape and v.shape[0] == -1 for v in graph.inputs)
        batch = max(largest, target.profile.opt) if dynamic else largest
        feeds = [rows_of(golden[largest][0][v.name], batch) for v in graph.inputs]
        names = [o.name for o in graph.outputs]
        report: dict[str, Any] = {}
        best: tuple[float, Choice, dict[str, int]] | None = None
        for choice in self.candidates(precision):
            try:
                exe = self.prepare(copy.deepcopy(graph), {"precision": precision, "conv_algo": choice.conv_algo,
                                                          "cuda_graphs": choice.cuda_graphs, "math": choice.math,
                                                          "contexts": 1})
                checks = [compare(dict(zip(names, exe.run([ins[v.name] for v in graph.inputs]))), outs, tol)
                          for _, (ins, outs) in sorted(golden.items())]
                ms = median_seconds(lambda: exe.run(feeds), repeats) * 1e3
            except (KernelError, DeviceUnavailableError) as e:  # this candidate cannot run here; the others may
                report[choice.label()] = {"error": str(e)}
                continue
            ok = all(c.passed for c in checks)
            report[choice.label()] = {"median_ms": round(ms, 4), "accurate": ok,
                                      "max_abs_error": max(c.max_abs_error for c in checks)}
            if ok and (best is None or ms < best[0]):
                best = (ms, choice, dict(exe.plan.ctx.conv_choices))
        if best is None:
            raise KernelError(f"no cuda configuration matches the golden outputs within {tol.describe()}: {report}")
        choice = best[1]
        chosen = {"precision": precision, "conv_algo": choice.conv_algo, "cuda_graphs": choice.cuda_graphs,
                  "math": choice.math, "contexts": 2}
        ident = self.identity()
        tuning = {"choice": chosen, "tuned_batch": batch, "candidates": report, "device": self.backend.name,
                  "gpu_product": ident.gpu_product, "compute_capability": ident.compute_capability,
                  "backend_version": ident.backend_version, "conv_choices": best[2]}
        return {**chosen, "tuned_batch": batch, "candidates": report,
                "_files": {TUNING_FILE: (json.dumps(tuning, indent=2, sort_keys=True) + "\n").encode()}}


RUNTIME = CudaRuntime()
