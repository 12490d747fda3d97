"""The MKL GEMM binding against a float64 reference: strides, slices, thread splits, fallbacks."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kubetrt.runtime.kernels import blas, parallel



def assert_product(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """fp32 against a float64 reference: unit-normal data gives entries of size sqrt(K) and
    rounding error of about eps * sqrt(K) times that, so the tolerance is 1e-6 * K."""
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * a.shape[-1])


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def test_dev_environment_uses_mkl_on_x86() -> None:
    """The dev extra installs mkl on x86_64, so the model tests run the MKL path; fail if it did not load."""
    if platform.machine() != "x86_64":
        pytest.skip("mkl wheels exist for x86_64 only; NumPy's BLAS is the path here")
    if os.environ.get("KUBETRT_BLAS", "auto").lower() == "numpy":
        pytest.skip("KUBETRT_BLAS=numpy turns MKL off for this run")
    assert blas.BACKEND == "mkl"


@pytest.mark.parametrize("m,k,n", [(1, 512, 512), (2, 64, 8), (7, 300, 700), (49, 4608, 64), (300, 576, 64), (1024, 27, 16)])
def test_gemm_matches_numpy(m: int, k: int, n: int) -> None:
    a, b = _rand(m, k), _rand(k, n, seed=1)
    assert_product(blas.gemm(a, b), a, b)


def test_gemm_on_strided_rows_and_column_slices() -> None:
    big_a, big_b = _rand(400, 700), _rand(600, 900, seed=1)
    a, b = big_a[10:310, 50:650], big_b[:, 100:600]  # row strides larger than the row
    out_big = np.zeros((320, 800), dtype=np.float32)
    out = out_big[5:305, 200:700]
    blas.gemm(a, b, out)
    assert_product(out, a, b)
    assert not out_big[:5].any() and not out_big[:, :200].any() and not out_big[:, 700:].any(), "wrote outside `out`"


@pytest.mark.parametrize("m,k,n", [(49, 4608, 512), (196, 256, 1024), (1024, 144, 32)])
def test_threaded_splits_match_the_reference(m: int, k: int, n: int) -> None:
    """parallel.matmul hands MKL row slices (m >= n) or column slices (m < n) of the operands."""
    a, w = _rand(m, k), _rand(k, n, seed=4)
    assert_product(parallel.matmul(a, w), a, w)
    assert_product(parallel.matmul(a[0], w), a[0], w)


def test_fallbacks_keep_numpy_semantics() -> None:
    a64, b64 = _rand(300, 400).astype(np.float64), _rand(400, 300, seed=1).astype(np.float64)
    assert blas.gemm(a64, b64).dtype == np.float64
    np.testing.assert_allclose(blas.gemm(a64, b64), a64 @ b64)
    a = _rand(256, 256)
    cols_major = np.asfortranarray(_rand(256, 256, seed=1))  # unit row stride: not a BLAS row-major operand
    assert_product(blas.gemm(a, cols_major), a, cols_major)
    with pytest.raises(ValueError):
        blas.gemm(a, _rand(255, 256))


def test_kubetrt_blas_numpy_turns_mkl_off() -> None:
    code = "from kubetrt.runtime.kernels import blas; print(blas.BACKEND)"
    env = {**os.environ, "KUBETRT_BLAS": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "numpy"
