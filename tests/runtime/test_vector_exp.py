"""The jitted float32 exp (kernels/jit.py `expf`) and the kernels built on it: softmax rows and
GELU, against float64 references. These kernels replace libm and NumPy exp calls, so the checks
cover what those got right for free: NaN in, NaN out; overflow to inf; underflow (and -inf, a
masked logit) to exactly 0; every row width; ranges split across threads."""
from __future__ import annotations

import re
from math import erf
from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.accuracy import TOLERANCES, HOST
from kubetrt.runtime.kernels import jit

pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed: the NumPy forms run instead")

FP32 = TOLERANCES[("fp32", HOST)]
EXP_RELATIVE = 4e-7  # a few float32 ulps: the polynomial is within one, the 2^n scaling exact


def _exp(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    jit._exp_flat(y, 0, y.size)
    return y


def test_exp_is_within_a_few_ulps_over_float32s_whole_range() -> None:
    x = np.linspace(-87.3, 88.7, 400_001, dtype=np.float32)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(_exp(x) - want) / want) < EXP_RELATIVE


def test_exp_special_values_behave_as_numpys() -> None:
    x = np.array([np.nan, -np.inf, np.inf, -200.0, 200.0, 0.0, -0.0, 89.0, -104.0], np.float32)
    with np.errstate(over="ignore", under="ignore"):
        want = np.exp(x).astype(np.float32)
    got = _exp(x)
    assert np.isnan(got[0])
    # NumPy keeps float32 denormals below -87.3 where this flushes them to 0: both are below 1.2e-38
    np.testing.assert_array_equal(got[1:], np.where(want[1:] < np.finfo(np.float32).tiny, 0.0, want[1:]))


def test_exp_of_a_slice_leaves_the_rest_untouched() -> None:
    x = np.linspace(-3, 3, 100, dtype=np.float32)
    y = x.copy()
    jit._exp_flat(y, 10, 90)
    np.testing.assert_array_equal(y[:10], x[:10])
    np.testing.assert_array_equal(y[90:], x[90:])
    np.testing.assert_allclose(y[10:90], np.exp(x[10:90].astype(np.float64)), rtol=EXP_RELATIVE)


def _softmax64(x: np.ndarray, log: bool) -> np.ndarray:
    z = x.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True)) if log else np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", [(1, 1), (4, 3), (32, 10), (2, 4, 16, 16), (1, 1000), (3, 70_000)])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_match_float64(shape: tuple[int, ...], log: bool) -> None:
    x = (np.random.default_rng(sum(shape)).standard_normal(shape) * 6).astype(np.float32)
    got = jit.softmax_rows(x.copy(), log)
    np.testing.assert_allclose(got, _softmax64(x, log), rtol=0, atol=FP32)


def test_softmax_rows_split_across_threads_match_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(1).standard_normal((4096, 64)).astype(np.float32)
    whole = jit.softmax_rows(x.copy(), False)
    monkeypatch.setattr(jit, "THREADS", 2)
    monkeypatch.setattr(jit, "MIN_WORK_PER_THREAD", 1024)
    np.testing.assert_array_equal(jit.softmax_rows(x.copy(), False), whole)


def test_softmax_of_masked_logits_is_exactly_zero_there() -> None:
    """An attention mask writes -inf (or a huge negative number) into the logits it hides."""
    x = np.array([[0.5, -np.inf, 1.0, -1e30], [np.nan, 0.0, 1.0, 2.0]], np.float32)
    got = jit.softmax_rows(x.copy(), False)
    assert got[0, 1] == 0.0 and got[0, 3] == 0.0
    np.testing.assert_allclose(got[0, [0, 2]], _softmax64(x[:1, [0, 2]], False)[0], atol=FP32)
    assert np.isnan(got[1]).all()  # as NumPy's form: a NaN logit poisons its row


@pytest.mark.parametrize("n", [7, 2048, 65_536])
def test_gelu_matches_the_erf_formula(n: int) -> None:
    x = (np.random.default_rng(n).standard_normal(n) * 3).astype(np.float32)
    want = np.array([0.5 * v * (1 + erf(v / 2 ** 0.5)) for v in x.astype(np.float64)])
    np.testing.assert_allclose(jit.gelu(x, None), want, rtol=0, atol=FP32)
    in_place = x.copy()
    jit.gelu(in_place, in_place)
    np.testing.assert_allclose(in_place, want, rtol=0, atol=FP32)


def test_gelu_special_values() -> None:
    got = jit.gelu(np.array([np.nan, np.inf, 0.0, 100.0, -100.0], np.float32), None)
    assert np.isnan(got[0]) and got[1] == np.inf
    np.testing.assert_array_equal(got[2:], [0.0, 100.0, 0.0])


def _compiled_ir(kernel: Any, *args: Any) -> str:
    """LLVM IR of `kernel` compiled afresh with its own options, for these arguments (the cached
    build keeps no IR to read)."""
    import numba

    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options)(kernel.py_func)
    fresh(*args)
    return "\n".join(fresh.inspect_llvm().values())


def _gelu_kernel_calls() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Every kernel that applies the GELU form in a loop, with arguments that take that branch."""
    from kubetrt.runtime.kernels import sgemm

    f32, gelu = np.float32, jit.SCALAR_GELU
    rows, cols = np.ones((8, 32), f32), np.zeros(32, f32)
    image = np.ones((1, 4, 4, 16), f32)
    return {
        "gelu": (jit._gelu, (rows.ravel(), rows.ravel().copy(), 0, 8)),
        "sgemm tiles": (sgemm._tiles, (np.ones((8, 4), f32), np.ones((2, 4, sgemm.NR), f32), rows.copy(), rows, cols, False, gelu, f32(0), f32(0), 0, 4)),
        "epilogue": (jit._epilogue, (rows.copy(), cols, rows, True, False, gelu, f32(0), f32(0), 0, 8)),
        "depthwise nhwc": (jit._depthwise_nhwc, (image, np.ones((3, 3, 16), f32), np.zeros(16, f32), image.copy(), 1, 1, 1, 1, 1, 1, gelu, f32(0), f32(0), 0, 4)),
        "depthwise nchw": (jit._depthwise, (np.ones((1, 2, 6, 6), f32), np.ones((2, 1, 3, 3), f32), np.zeros(2, f32), np.zeros((1, 2, 4, 4), f32), 1, 1, 1, 1, gelu, f32(0), f32(0), 0, 2)),
    }


@pytest.mark.parametrize("name", list(_gelu_kernel_calls()))
def test_kernels_taking_gelu_compute_its_division_in_vectors(name: str) -> None:
    """gelu_erf divides by a value of each element. Under numba's default error model every such
    division tests its divisor for zero (to raise), which keeps the loop to one element at a time:
    the sgemm tile's GELU cost more than its matrix product. So every kernel that inlines
    gelu_erf compiles with the NumPy error model, and its IR divides whole vectors."""
    kernel, args = _gelu_kernel_calls()[name]
    ir = _compiled_ir(kernel, *args)
    assert re.search(r"fdiv[^\n]*<\d+ x float>", ir), f"{name}: no vector division in its IR"
