"""kernels/channel_affine.py: MulAdd's pass on the OpenMP team computes what the one-thread pass
does, for every row of contiguous tensors and of a growing Concat's views, at each team size."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.kernels import channel_affine, jit, omp
from kubetrt.runtime.kernels.channel_affine import ChannelAffine

pytestmark = pytest.mark.skipif(not channel_affine.AVAILABLE, reason="the team kernel needs numba and libgomp")

rng = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def expected(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, relu: bool) -> np.ndarray:
    y = x.astype(np.float64) * scale + shift
    return np.maximum(y, 0) if relu else y


@pytest.mark.parametrize("threads", sorted({1, 2, omp.TEAM}))
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels", [3, 16, 37, 256])
def test_contiguous_rows(channels: int, relu: bool, threads: int) -> None:
    x = f32(1, 2 * channel_affine.TEAM_MIN_ELEMENTS // channels + 1, 1, channels)  # an odd row count: halves differ
    scale, shift = f32(channels), f32(channels)
    got = ChannelAffine(scale, shift, relu)(x, threads=threads)
    # the same arithmetic as the one-thread pass (one fused multiply-add per element), every row written
    np.testing.assert_array_equal(got, jit.rows_affine(x, scale, shift, relu))
    np.testing.assert_allclose(got, expected(x, scale, shift, relu), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", sorted({1, 2, omp.TEAM}))
def test_a_view_of_a_growing_buffer_is_read_where_it_lies(threads: int) -> None:
    buf = f32(2, 40, 41, 96)
    view = buf[..., :72]  # a Concat's leading channels: rows 96 floats apart
    assert jit.row_stride(view) == 96 and view.size >= channel_affine.TEAM_MIN_ELEMENTS
    scale, shift = f32(72), f32(72)
    before = buf.copy()
    got = ChannelAffine(scale, shift, True)(view, threads=threads)
    assert got.flags.c_contiguous and not np.shares_memory(got, buf)
    np.testing.assert_array_equal(got, jit.rows_affine(view, scale, shift, True))
    np.testing.assert_allclose(got, expected(view, scale, shift, True), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(buf, before)  # the buffer is only read


def test_the_team_choice_runs_large_tensors_and_small_ones_stay_on_this_thread(team_affine_rows: list[int]) -> None:
    affine = ChannelAffine(f32(64), f32(64), False)
    small, large = f32(1, 4, 4, 64), f32(1, 32, 32, 64)
    for x in (small, large):
        np.testing.assert_array_equal(affine(x), jit.rows_affine(x, affine.scale, affine.shift, False))
    assert team_affine_rows == [32 * 32 // 4]  # only the large one, its 64-channel rows joined four to a row
