"""float32 GEMM through oneMKL when the `mkl` extra is installed, NumPy's BLAS otherwise.

Why: on the convolution shapes of CNNs, MKL's sgemm beats OpenBLAS's, most on the few-row GEMMs
of batch 1. MKL's packed-weights API was tried and left out: its packed copies are larger than
the weights, and at batch 1 the weights come from DRAM, so streaming the bigger copy ate the
gain. MKL runs sequential: the runtime's own pool splits the work (parallel.py explains why not BLAS threads).
KUBETRT_BLAS=numpy turns it off. The binding is a few ctypes calls, so NumPy stays the only
array library and a pod without the extra loses nothing but speed.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from .native import load_first

_ROW_MAJOR, _NO_TRANS, _SEQUENTIAL = 101, 111, 1
_F32 = np.dtype(np.float32)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KUBETRT_BLAS", "auto").lower() == "numpy":
        return None
    lib = load_first(("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"))
    if lib is None:
        return None
    lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    lib.MKL_Set_Threading_Layer(_SEQUENTIAL)  # must precede every other MKL call
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    lib.cblas_sgemm.restype = None
    return lib


_mkl = _load()
BACKEND = "mkl" if _mkl is not None else "numpy"
MIN_MKL_MACS = 1 << 20  # below this MKL's per-call cost loses to NumPy's


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


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out (M, N) = a (M, K) @ b (K, N); MKL where it pays, np.matmul otherwise."""
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    if _mkl is None or a.dtype != _F32 or b.dtype != _F32 or out.dtype != _F32 or a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return np.matmul(a, b, out=out)
    m, k = a.shape
    n = b.shape[1]
    if m < 2 or m * n * k < MIN_MKL_MACS:
        return np.matmul(a, b, out=out)
    lda, ldb, ldc = _row_stride(a), _row_stride(b), _row_stride(out)
    if lda is None or ldb is None or ldc is None or out.shape != (m, n) or b.shape[0] != k or not out.flags.writeable \
            or np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return np.matmul(a, b, out=out)
    _mkl.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, out.ctypes.data, ldc)
    return out
