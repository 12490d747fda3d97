"""float32 GEMM through oneMKL when the `mkl` extra is installed, NumPy's BLAS otherwise.

Why: on the convolution shapes of ResNet50 and MobileNetV2, MKL's sgemm runs 1.2-1.8x
OpenBLAS's (bench: 196x2304x256 65 -> 85 GFLOP/s, 49x4608x512 33 -> 61, one core), most on the
few-row GEMMs of batch 1, where OpenBLAS spends its time re-packing the weights. MKL runs
sequential: the runtime's own pool splits the work (parallel.py explains why not BLAS threads).
KUBETRT_BLAS=numpy turns it off. The binding is a few ctypes calls, so NumPy stays the only
array library and a pod without the extra loses nothing but speed.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np

_ROW_MAJOR, _NO_TRANS, _PACKED, _B_MATRIX, _SEQUENTIAL = 101, 111, 151, 162, 1
_F32 = np.dtype(np.float32)


def _candidates() -> list[Path]:
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    return [d / name for d in dirs for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")]


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KUBETRT_BLAS", "auto").lower() == "numpy":
        return None
    for path in _candidates():
        if not path.is_file():
            continue
        try:
            lib = ctypes.CDLL(str(path))  # RTLD_LOCAL: MKL's symbols never shadow NumPy's OpenBLAS
        except OSError:
            continue
        lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
        lib.MKL_Set_Threading_Layer(_SEQUENTIAL)  # must precede every other MKL call
        i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        lib.cblas_sgemm.restype = None
        lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
        lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
        lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
        lib.cblas_sgemm_pack.restype = None
        lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
        lib.cblas_sgemm_compute.restype = None
        return lib
    return None


_mkl = _load()
BACKEND = "mkl" if _mkl is not None else "numpy"
MIN_MKL_MACS = 1 << 20  # below ~1M multiply-adds MKL's 15-20 us call cost loses to NumPy's
PACK_MAX_ROWS = 64  # products this short re-read the weights more than the activations: pack them
PACK_MIN_ELEMENTS = 1 << 18  # a packed copy costs about 2 MB of its own; not worth it under 1 MiB


def _row_stride(x: np.ndarray) -> int | None:
    """Leading dimension (in elements) of a 2-D float32 array with unit column stride, or None."""
    rows, cols = x.shape
    s0, s1 = x.strides
    if s1 != 4 and cols > 1:
        return None
    if rows == 1:
        return max(1, cols)
    if s0 % 4 or s0 < 4 * cols:
        return None
    return s0 // 4


class Weights:
    """A GEMM's constant right-hand side (a layer's weights), packed by MKL for few-row products.

    OpenBLAS and MKL's plain sgemm re-pack B on every call; with 49 rows (ResNet50's last stage at
    batch 1) that packing costs as much as the product. A packed copy is made lazily, once per
    column slice the thread split asks for, so models that never run short products pay nothing.
    """

    __slots__ = ("array", "_packs")

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array)
        self._packs: dict[tuple[int, int], np.ndarray] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def packed(self, lo: int, hi: int) -> np.ndarray:
        buf = self._packs.get((lo, hi))
        if buf is None:
            assert _mkl is not None
            k = self.array.shape[0]
            size = _mkl.cblas_sgemm_pack_get_size(_B_MATRIX, 1, hi - lo, k)
            buf = np.empty(-(-size // 4), dtype=np.float32)  # MKL keeps addresses inside: never copied
            _mkl.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _NO_TRANS, 1, hi - lo, k, 1.0, self.array[:, lo:].ctypes.data, self.array.shape[1], buf.ctypes.data)
            self._packs[(lo, hi)] = buf  # a race packs twice; both copies are equal
        return buf


def gemm(a: np.ndarray, b: np.ndarray | Weights, out: np.ndarray | None = None, cols: tuple[int, int] | None = None) -> np.ndarray:
    """out (M, N') = a (M, K) @ b[:, cols] (K, N'); MKL where it pays, np.matmul otherwise."""
    bb = b.array if isinstance(b, Weights) else b
    if cols is not None:
        bb = bb[:, cols[0]:cols[1]]
    if out is None:
        out = np.empty((a.shape[0], bb.shape[1]), dtype=np.result_type(a, bb))
    if _mkl is None or a.dtype != _F32 or bb.dtype != _F32 or out.dtype != _F32 or a.ndim != 2 or bb.ndim != 2 or out.ndim != 2:
        return np.matmul(a, bb, out=out)
    m, k = a.shape
    n = bb.shape[1]
    if m < 2 or m * n * k < MIN_MKL_MACS:
        return np.matmul(a, bb, out=out)
    lda, ldb, ldc = _row_stride(a), _row_stride(bb), _row_stride(out)
    if lda is None or ldb is None or ldc is None or out.shape != (m, n) or bb.shape[0] != k or not out.flags.writeable \
            or np.may_share_memory(out, a) or np.may_share_memory(out, bb):
        return np.matmul(a, bb, out=out)
    if isinstance(b, Weights) and m <= PACK_MAX_ROWS and k * n >= PACK_MIN_ELEMENTS:
        lo, hi = cols if cols is not None else (0, n)
        _mkl.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, a.ctypes.data, lda, b.packed(lo, hi).ctypes.data, n, 0.0, out.ctypes.data, ldc)
        return out
    _mkl.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, lda, bb.ctypes.data, ldb, 0.0, out.ctypes.data, ldc)
    return out
