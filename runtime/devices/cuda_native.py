"""What the cuda runtime runs natively on a GPU instead of composing CuPy array operations:
cuBLAS GEMMs it may record in a CUDA Graph, and one-launch kernels for the convolutions,
gathers and pools that CuPy would spell as a dozen launches each.

CuPy refuses to call cuBLAS while a stream is being captured, so GEMMs go through a handle of
our own per stream, with its own workspace (cuBLAS may not allocate during capture); the
arguments the kernels take are the ones `kernels/cuda.py` passes to `xp`, so the NumPy
stand-in remains the reference for their math. Nothing here runs without a GPU.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

WORKSPACE_BYTES = 32 << 20
MATH_MODES = ("default", "tf32")  # fp32 GEMMs: exact fp32, or TensorFloat-32 tensor cores

_OP_N = 0
_DTYPE = {np.dtype(np.float32).str: 0, np.dtype(np.float16).str: 2}  # cudaDataType
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_GEMM_DEFAULT = -1


def load_nvidia_library(name: str, sonames: list[str], extra_paths: list[str] | None = None) -> ctypes.CDLL:
    """An NVIDIA library as CuPy finds its own (cuda.pathfinder: pip wheels or the CUDA toolkit),
    else by path or soname on the loader's path."""
    names = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # the loader CuPy itself uses

        path = load_nvidia_dynamic_lib(name).abs_path
        if path:
            names.append(path)
    except Exception:  # older CuPy: no pathfinder, or it does not know this library
        pass
    names += (extra_paths or []) + sonames
    errors = []
    for candidate in names:
        try:
            return ctypes.CDLL(candidate)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
    raise OSError(f"{name} could not be loaded: " + "; ".join(errors))


def _load_cublas() -> ctypes.CDLL:
    return load_nvidia_library("cublas", ["libcublas.so.13", "libcublas.so.12", "libcublas.so"])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} failed with status {status}")


class Cublas:
    """Row-major batched GEMMs on the current CuPy stream, one cuBLAS handle per stream."""

    def __init__(self, cp: Any, math_mode: str = "default") -> None:
        self.cp = cp
        self.math_mode = math_mode
        self.lib = _load_cublas()
        lib = self.lib
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._handles: dict[int, tuple[ctypes.c_void_p, Any]] = {}
        self._lock = threading.Lock()
        self._scalars = (ctypes.c_float * 2)(1.0, 0.0)  # alpha, beta: host pointers, captured by value
        self._alpha = ctypes.addressof(self._scalars)
        self._beta = self._alpha + ctypes.sizeof(ctypes.c_float)

    def _handle(self) -> ctypes.c_void_p:
        stream = self.cp.cuda.get_current_stream().ptr
        got = self._handles.get(stream)
        if got is None:
            with self._lock:
                handle = ctypes.c_void_p()
                _check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "create")
                _check(self.lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream)), "set stream")
                workspace = self.cp.empty(WORKSPACE_BYTES, dtype=self.cp.uint8)
                _check(self.lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace.data.ptr), WORKSPACE_BYTES),
                       "set workspace")
                got = self._handles[stream] = (handle, workspace)
        return got[0]

    def matmul(self, a: Any, b: Any) -> Any:
        """a @ b for a (..., m, k) and b (..., k, n) whose batch dims broadcast; the output is new."""
        cp = self.cp
        if a.dtype != b.dtype or a.dtype.str not in _DTYPE or a.ndim < 2 or b.ndim < 2:
            return cp.matmul(a, b)
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        if k != k2:
            raise ValueError(f"matmul: inner dimensions differ, {a.shape} @ {b.shape}")
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        count = int(np.prod(batch)) if batch else 1
        strides = []
        for x in (a, b):
            lead = int(np.prod(x.shape[:-2])) if x.ndim > 2 else 1
            if lead not in (1, count):  # a partial broadcast is no single stride
                return cp.matmul(a, b)
            strides.append(0 if lead == 1 and count > 1 else x.shape[-2] * x.shape[-1])
        a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
        out = cp.empty(batch + (m, n), dtype=a.dtype)
        if count == 0 or m == 0 or n == 0:
            return out
        if k == 0:
            out.fill(0)
            return out
        dt = _DTYPE[a.dtype.str]
        compute = _COMPUTE_32F_FAST_TF32 if self.math_mode == "tf32" and a.dtype == np.float32 else _COMPUTE_32F
        # row-major C = A @ B is column-major C^T = B^T @ A^T: swap the operands, no transposes
        _check(self.lib.cublasGemmStridedBatchedEx(
            self._handle(), _OP_N, _OP_N, n, m, k, self._alpha,
            ctypes.c_void_p(b.data.ptr), dt, n, strides[1],
            ctypes.c_void_p(a.data.ptr), dt, k, strides[0],
            self._beta, ctypes.c_void_p(out.data.ptr), dt, n, m * n,
            count, compute, _GEMM_DEFAULT), "GemmStridedBatchedEx")
        return out


_SOURCE = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, long i) { return __half2float(p[i]); }
__device__ __forceinline__ void st(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, long i, float v) { p[i] = __float2half(v); }

// f(ih, iw, i, j) for every tap (i, j) of output pixel (oh, ow)'s window that lies inside the
// input: the window geometry of the depthwise convolution and the pools, written once
template <typename F>
__device__ __forceinline__ void each_tap(int oh, int ow, int H, int W, int KH, int KW, int SH, int SW,
                                         int PH, int PW, int DH, int DW, F f) {
  for (int i = 0; i < KH; ++i) {
    int ih = oh * SH - PH + i * DH;
    if (ih < 0 || ih >= H) continue;
    for (int j = 0; j < KW; ++j) {
      int iw = ow * SW - PW + j * DW;
      if (iw < 0 || iw >= W) continue;
      f(ih, iw, i, j);
    }
  }
}

template <typename T, typename I>
__global__ void depthwise(const T* x, const T* w, const T* bias, const T* res, T* y, I total,
                          int C, int H, int W, int OH, int OW, int KH, int KW, int SH, int SW,
                          int PH, int PW, int DH, int DW, int has_bias, int has_res) {
  I idx = (I)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  int ow = idx % OW; I t = idx / OW; int oh = t % OH; t /= OH; int c = t % C;
  const I base = t * H * W;  // t = n * C + c
  float acc = 0.f;
  each_tap(oh, ow, H, W, KH, KW, SH, SW, PH, PW, DH, DW, [&](int ih, int iw, int i, int j) {
    acc += ld(x, base + (I)ih * W + iw) * ld(w, c * KH * KW + i * KW + j);
  });
  float v = acc;
  if (has_bias) v += ld(bias, c);
  if (has_res) v += ld(res, idx);
  st(y, idx, ACTIVATION);
}

// grid (P blocks, C*KH*KW rows, N): the row's channel and tap are uniform per block, so a thread
// divides once (its output pixel) instead of once per coordinate
template <typename T, typename I>
__global__ void im2col(const T* x, T* cols, I total, int C, int H, int W, int OH, int OW,
                       int KH, int KW, int SH, int SW, int PH, int PW, int DH, int DW) {
  const int P = OH * OW, R = C * KH * KW;
  int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= P) return;
  int r = blockIdx.y, n = blockIdx.z;
  int c = r / (KH * KW), i = (r / KW) % KH, j = r % KW;
  int oh = p / OW, ow = p - oh * OW;
  int ih = oh * SH - PH + i * DH, iw = ow * SW - PW + j * DW;
  I out = ((I)n * R + r) * P + p;
  cols[out] = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? x[(((I)n * C + c) * H + ih) * W + iw] : T(0.f);
}

// y = act(y + bias[c] + res) in place over (N, C, P); grid (P blocks, C, N)
template <typename T, typename I>
__global__ void bias_act(T* y, const T* bias, const T* res, I total, int C, int P, int has_bias, int has_res) {
  int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= P) return;
  int c = blockIdx.y;
  I idx = ((I)blockIdx.z * C + c) * P + p;
  float v = ld(y, idx);
  if (has_bias) v += ld(bias, c);
  if (has_res) v += ld(res, idx);
  st(y, idx, ACTIVATION);
}

template <typename T, typename I>
__global__ void pool(const T* x, T* y, I total, int H, int W, int OH, int OW, int KH, int KW,
                     int SH, int SW, int PH, int PW, int EH, int EW, int DH, int DW, int is_max, int include_pad) {
  I idx = (I)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  int ow = idx % OW; I t = idx / OW; int oh = t % OH; t /= OH;
  const I base = t * H * W;
  float acc = is_max ? __int_as_float(0xff800000) : 0.f;  // -inf
  int ch = 0, cw = 0;
  for (int i = 0; i < KH; ++i) {
    int ih = oh * SH - PH + i * DH;
    if (include_pad ? (ih >= -PH && ih < H + EH) : (ih >= 0 && ih < H)) ++ch;
  }
  for (int j = 0; j < KW; ++j) {
    int iw = ow * SW - PW + j * DW;
    if (include_pad ? (iw >= -PW && iw < W + EW) : (iw >= 0 && iw < W)) ++cw;
  }
  each_tap(oh, ow, H, W, KH, KW, SH, SW, PH, PW, DH, DW, [&](int ih, int iw, int, int) {
    float v = ld(x, base + (I)ih * W + iw);
    acc = is_max ? fmaxf(acc, v) : acc + v;
  });
  st(y, idx, is_max ? acc : acc / (float)max(ch * cw, 1));
}
"""

_BLOCK = 256
GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


class NativeKernels:
    """The one-launch kernels, compiled per dtype and fused activation on first use."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._modules: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _kernel(self, name: str, dtype: np.dtype, total: Any, activation: str = "v") -> Any:
        """32-bit index arithmetic where the output allows it: 64-bit division costs several times more."""
        with self._lock:
            module = self._modules.get(activation)
            if module is None:
                names = [f"{k}<{t}, {i}>" for k in ("depthwise", "im2col", "bias_act", "pool") for t in ("float", "__half")
                         for i in ("int", "long")]
                module = self._modules[activation] = self.cp.RawModule(
                    code=_SOURCE.replace("ACTIVATION", activation), options=("--std=c++17",), name_expressions=names)
        index = "int" if isinstance(total, np.int32) else "long"
        return module.get_function(f"{name}<{'__half' if dtype == np.float16 else 'float'}, {index}>")

    @staticmethod
    def _index(total: int, *arrays: Any) -> Any:
        """`total` as the index type of a kernel over these arrays (see `_kernel`)."""
        span = max(a.size for a in arrays)
        return np.int32(total) if span < 2**31 else np.int64(total)

    def _launch(self, kernel: Any, total: int, args: tuple[Any, ...]) -> None:
        if total:
            kernel(((total + _BLOCK - 1) // _BLOCK,), (_BLOCK,), args)

    @staticmethod
    def _check_grid(*rows: int) -> None:
        if max(rows) > GRID_YZ:
            raise ValueError(f"a launch grid of rows {rows} exceeds CUDA's {GRID_YZ} blocks in y and z")

    def _launch_rows(self, kernel: Any, width: int, rows: tuple[int, ...], args: tuple[Any, ...]) -> None:
        """One block row per (rows...) index, threads across `width` contiguous elements."""
        if width and all(rows):
            kernel(((width + _BLOCK - 1) // _BLOCK, *rows), (_BLOCK,), args)

    def bias_act(self, y: Any, bias: Any, residual: Any, activation: str) -> Any:
        """act(y + bias + residual) in place, y contiguous NC..., bias per channel (C elements)."""
        cp = self.cp
        n, c = y.shape[:2]
        width = y.size // max(n * c, 1)
        res = y if residual is None else cp.ascontiguousarray(residual)
        b = y if bias is None else cp.ascontiguousarray(bias)
        total = self._index(y.size, y)
        self._check_grid(c, n)
        self._launch_rows(self._kernel("bias_act", y.dtype, total, activation), width, (c, n),
                          (y, b, res, total, np.int32(c), np.int32(width), np.int32(bias is not None),
                           np.int32(residual is not None)))
        return y

    def depthwise(self, x: Any, w: Any, bias: Any, residual: Any, activation: str, oh: int, ow: int,
                  strides: list[int], pads: list[int], dil: list[int]) -> Any:
        """act(depthwise_conv(x, w) + bias + residual), NCHW, w (C, 1, KH, KW)."""
        cp = self.cp
        n, c, h, wd = x.shape
        x = cp.ascontiguousarray(x)
        y = cp.empty((n, c, oh, ow), dtype=x.dtype)
        res = x if residual is None else cp.ascontiguousarray(residual)
        b = x if bias is None else cp.ascontiguousarray(bias)
        i32 = np.int32
        total = self._index(y.size, x, y)
        self._launch(self._kernel("depthwise", x.dtype, total, activation), y.size,
                     (x, w, b, res, y, total, i32(c), i32(h), i32(wd), i32(oh), i32(ow),
                      i32(w.shape[2]), i32(w.shape[3]), i32(strides[0]), i32(strides[1]), i32(pads[0]), i32(pads[1]),
                      i32(dil[0]), i32(dil[1]), i32(bias is not None), i32(residual is not None)))
        return y

    def im2col(self, x: Any, kh: int, kw: int, oh: int, ow: int, strides: list[int], pads: list[int],
               dil: list[int]) -> Any:
        """(N, C*KH*KW, OH*OW) columns, channel-major like the weights' (O, C*KH*KW)."""
        cp = self.cp
        n, c, h, wd = x.shape
        x = cp.ascontiguousarray(x)
        cols = cp.empty((n, c * kh * kw, oh * ow), dtype=x.dtype)
        i32 = np.int32
        total = self._index(cols.size, x, cols)
        self._check_grid(c * kh * kw, n)
        self._launch_rows(self._kernel("im2col", x.dtype, total), oh * ow, (c * kh * kw, n),
                          (x, cols, total, i32(c), i32(h), i32(wd), i32(oh), i32(ow), i32(kh), i32(kw),
                           i32(strides[0]), i32(strides[1]), i32(pads[0]), i32(pads[1]), i32(dil[0]), i32(dil[1])))
        return cols

    def pool(self, x: Any, k: tuple[int, ...], oh: int, ow: int, strides: list[int], begin: list[int],
             end: list[int], dil: list[int], is_max: bool, include_pad: bool) -> Any:
        """Max or average pooling, NCHW; averages divide as `nn.pool_counts` says."""
        cp = self.cp
        n, c, h, wd = x.shape
        x = cp.ascontiguousarray(x)
        y = cp.empty((n, c, oh, ow), dtype=x.dtype)
        i32 = np.int32
        total = self._index(y.size, x, y)
        self._launch(self._kernel("pool", x.dtype, total), y.size,
                     (x, y, total, i32(h), i32(wd), i32(oh), i32(ow), i32(k[0]), i32(k[1]),
                      i32(strides[0]), i32(strides[1]), i32(begin[0]), i32(begin[1]), i32(end[0]), i32(end[1]),
                      i32(dil[0]), i32(dil[1]), i32(is_max), i32(include_pad)))
        return y
