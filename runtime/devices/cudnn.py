"""Convolutions by cuDNN, the cuda runtime's `cudnn` conv algorithm: an implicit-GEMM convolution
reads the input where it lies, where im2col first writes it out kernel-size times over; but on
small inputs one im2col and one cuBLAS GEMM often finish first. So each layer and input shape runs
on whichever was faster when timed on this GPU, cuDNN's best algorithm (cudnnFind) or the GEMM
path, as a TensorRT build picks a tactic per layer. The plan records the choices, and an engine
tuned on one GPU product replays them there instead of measuring again.

Like cuBLAS in cuda_native.py: a handle and a workspace per stream, so that CUDA Graph capture
records the calls and two execution contexts never share scratch memory. The search allocates,
so it runs on a layer's first call, which the warm-up before capture always is. Nothing here runs
without a GPU.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .cuda_native import load_nvidia_library

_NCHW = 0
_DATA_TYPE = {np.dtype(np.float32).str: 0, np.dtype(np.float16).str: 2}  # cudnnDataType_t
_COMPUTE_FLOAT = 0
_CROSS_CORRELATION = 1
_TENSOR_OP_MATH, _FMA_MATH = 1, 3  # FMA: exact fp32, no TensorFloat-32
_SEARCHED = 8
GEMM_PATH = -1  # a layer's choice: the caller's im2col/cuBLAS path, not cuDNN
_TIMED_RUNS = 5


class _FwdAlgoPerf(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("math_type", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


def _load_cudnn() -> ctypes.CDLL:
    wheel_dirs: list[str] = []
    try:
        import nvidia.cudnn  # the nvidia-cudnn-cu12/cu13 wheel PyTorch also uses

        wheel_dirs = [f"{p}/lib/libcudnn.so.9" for p in nvidia.cudnn.__path__]
    except ImportError:
        pass
    return load_nvidia_library("cudnn", ["libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"], wheel_dirs)


class CudnnError(RuntimeError):
    pass


class Cudnn:
    """cuDNN on the current CuPy stream for one math mode (as `Cublas`)."""

    def __init__(self, cp: Any, math_mode: str = "default") -> None:
        self.cp = cp
        self.math_mode = math_mode
        self.lib = lib = _load_cudnn()
        v, i, p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        lib.cudnnGetErrorString.restype = ctypes.c_char_p
        lib.cudnnGetErrorString.argtypes = [i]
        for name in ("cudnnCreate", "cudnnCreateTensorDescriptor", "cudnnCreateFilterDescriptor",
                     "cudnnCreateConvolutionDescriptor"):
            getattr(lib, name).argtypes = [p(v)]
        lib.cudnnSetStream.argtypes = [v, v]
        lib.cudnnSetTensor4dDescriptor.argtypes = [v, i, i, i, i, i, i]
        lib.cudnnSetFilter4dDescriptor.argtypes = [v, i, i, i, i, i, i]
        lib.cudnnSetConvolution2dDescriptor.argtypes = [v, i, i, i, i, i, i, i, i]
        lib.cudnnSetConvolutionGroupCount.argtypes = [v, i]
        lib.cudnnSetConvolutionMathType.argtypes = [v, i]
        lib.cudnnGetConvolution2dForwardOutputDim.argtypes = [v, v, v, p(i), p(i), p(i), p(i)]
        lib.cudnnFindConvolutionForwardAlgorithm.argtypes = [v, v, v, v, v, i, p(i), p(_FwdAlgoPerf)]
        lib.cudnnGetConvolutionForwardWorkspaceSize.argtypes = [v, v, v, v, v, i, p(ctypes.c_size_t)]
        lib.cudnnConvolutionForward.argtypes = [v, v, v, v, v, v, v, i, v, ctypes.c_size_t, v, v, v]
        self.version = int(lib.cudnnGetVersion())
        self._streams: dict[int, list[Any]] = {}  # stream -> [handle, workspace, workspace bytes]
        self._lock = threading.Lock()
        self._scalars = (ctypes.c_float * 2)(1.0, 0.0)  # alpha, beta: host pointers, captured by value
        self.alpha = ctypes.c_void_p(ctypes.addressof(self._scalars))
        self.beta = ctypes.c_void_p(ctypes.addressof(self._scalars) + ctypes.sizeof(ctypes.c_float))

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise CudnnError(f"cuDNN {what} failed: {self.lib.cudnnGetErrorString(status).decode()} (status {status})")

    def new(self, create: Any) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        self.check(create(ctypes.byref(out)), create.__name__)
        return out

    def stream_state(self) -> list[Any]:
        stream = self.cp.cuda.get_current_stream().ptr
        state = self._streams.get(stream)
        if state is None:
            with self._lock:
                handle = self.new(self.lib.cudnnCreate)
                self.check(self.lib.cudnnSetStream(handle, ctypes.c_void_p(stream)), "set stream")
                state = self._streams[stream] = [handle, None, 0]
        return state

    def workspace(self, state: list[Any], size: int) -> ctypes.c_void_p:
        """This stream's scratch memory, grown to `size` (a warm-up run sizes it before capture)."""
        if size > state[2]:
            state[1], state[2] = self.cp.empty(size, dtype=self.cp.uint8), size
        return ctypes.c_void_p(state[1].data.ptr if state[1] is not None else 0)

    def layer(self, w: Any, pads: list[int], strides: list[int], dil: list[int], group: int,
              choices: dict[str, int], key: str) -> CudnnConv:
        return CudnnConv(self, w, pads, strides, dil, group, choices, key)


class CudnnConv:
    """One convolution layer: y = conv(x, w), NCHW, symmetric padding. `choices` maps
    'layer NxCxHxW' to the algorithm used there (GEMM_PATH: the caller's); a preset entry is used
    as it is."""

    def __init__(self, dnn: Cudnn, w: Any, pads: list[int], strides: list[int], dil: list[int], group: int,
                 choices: dict[str, int], key: str) -> None:
        lib = dnn.lib
        self.dnn, self.w, self.choices, self.key = dnn, dnn.cp.ascontiguousarray(w), choices, key
        self.dtype = _DATA_TYPE[self.w.dtype.str]
        o, cg, kh, kw = (int(d) for d in self.w.shape)
        self.filt = dnn.new(lib.cudnnCreateFilterDescriptor)
        dnn.check(lib.cudnnSetFilter4dDescriptor(self.filt, self.dtype, _NCHW, o, cg, kh, kw), "filter descriptor")
        self.conv = dnn.new(lib.cudnnCreateConvolutionDescriptor)
        geometry = [int(v) for v in (pads[0], pads[1], strides[0], strides[1], dil[0], dil[1])]
        dnn.check(lib.cudnnSetConvolution2dDescriptor(self.conv, *geometry, _CROSS_CORRELATION, _COMPUTE_FLOAT),
                  "convolution descriptor")
        dnn.check(lib.cudnnSetConvolutionGroupCount(self.conv, int(group)), "group count")
        exact = self.dtype == _DATA_TYPE[np.dtype(np.float32).str] and dnn.math_mode != "tf32"
        dnn.check(lib.cudnnSetConvolutionMathType(self.conv, _FMA_MATH if exact else _TENSOR_OP_MATH), "math type")
        self._shapes: dict[tuple[int, ...], tuple[Any, Any, tuple[int, ...], int, int]] = {}

    def _tensor(self, shape: tuple[int, ...]) -> ctypes.c_void_p:
        d = self.dnn.new(self.dnn.lib.cudnnCreateTensorDescriptor)
        self.dnn.check(self.dnn.lib.cudnnSetTensor4dDescriptor(d, _NCHW, self.dtype, *shape), "tensor descriptor")
        return d

    def _plan(self, shape: tuple[int, ...], expect: tuple[int, ...], x: Any,
              gemm_path: Callable[[], Any]) -> tuple[Any, Any, tuple[int, ...], int, int]:
        dnn, lib = self.dnn, self.dnn.lib
        xd = self._tensor(shape)
        dims = [ctypes.c_int() for _ in range(4)]
        dnn.check(lib.cudnnGetConvolution2dForwardOutputDim(self.conv, xd, self.filt, *[ctypes.byref(d) for d in dims]),
                  "output dims")
        out = tuple(d.value for d in dims)
        if out != expect:
            raise CudnnError(f"conv {self.key}: cuDNN's output {out} differs from the graph's {expect}")
        yd = self._tensor(out)
        state = dnn.stream_state()
        name = f"{self.key} {'x'.join(map(str, shape))}"
        algo = self.choices.get(name)
        if algo is None:
            perfs = (_FwdAlgoPerf * _SEARCHED)()
            found = ctypes.c_int()
            dnn.check(lib.cudnnFindConvolutionForwardAlgorithm(state[0], xd, self.filt, self.conv, yd, _SEARCHED,
                                                               ctypes.byref(found), perfs), "algorithm search")
            usable = [int(pf.algo) for pf in perfs[: found.value] if pf.status == 0]
            algo = GEMM_PATH  # where cuDNN has no algorithm for this layer, the GEMMs run it
            if usable:
                ws = self._workspace_size(state, xd, yd, usable[0])
                own = self._time_ms(lambda: self._forward(x, (xd, yd, out, usable[0], ws)))
                algo = GEMM_PATH if self._time_ms(gemm_path) < own else usable[0]
            self.choices[name] = algo
        planned = self._shapes[shape] = (xd, yd, out, algo,
                                         0 if algo == GEMM_PATH else self._workspace_size(state, xd, yd, algo))
        return planned

    def _workspace_size(self, state: list[Any], xd: Any, yd: Any, algo: int) -> int:
        size = ctypes.c_size_t()
        self.dnn.check(self.dnn.lib.cudnnGetConvolutionForwardWorkspaceSize(
            state[0], xd, self.filt, self.conv, yd, algo, ctypes.byref(size)), "workspace size")
        return int(size.value)

    def _time_ms(self, launch: Callable[[], Any]) -> float:
        """GPU time of one call, launched back to back after a warm-up call (outside capture)."""
        cp = self.dnn.cp
        launch()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(_TIMED_RUNS):
            launch()
        end.record()
        end.synchronize()
        return float(cp.cuda.get_elapsed_time(start, end)) / _TIMED_RUNS

    def _forward(self, x: Any, planned: tuple[Any, Any, tuple[int, ...], int, int]) -> Any:
        dnn = self.dnn
        xd, yd, out, algo, ws = planned
        state = dnn.stream_state()
        scratch = dnn.workspace(state, ws)
        y = dnn.cp.empty(out, dtype=x.dtype)
        dnn.check(dnn.lib.cudnnConvolutionForward(
            state[0], dnn.alpha, xd, ctypes.c_void_p(x.data.ptr), self.filt, ctypes.c_void_p(self.w.data.ptr),
            self.conv, algo, scratch, ws, dnn.beta, yd, ctypes.c_void_p(y.data.ptr)), "convolution")
        return y

    def __call__(self, x: Any, oh: int, ow: int, gemm_path: Callable[[], Any]) -> Any:
        x = self.dnn.cp.ascontiguousarray(x)
        shape = tuple(int(d) for d in x.shape)
        planned = self._shapes.get(shape) or self._plan(shape, (shape[0], int(self.w.shape[0]), int(oh), int(ow)),
                                                        x, gemm_path)
        return gemm_path() if planned[3] == GEMM_PATH else self._forward(x, planned)
