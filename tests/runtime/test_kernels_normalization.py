"""InstanceNormalization and GroupNormalization against onnxruntime: every spatial rank, both
GroupNormalization forms (opset 18: scale per group; opset 21: per channel), and stable statistics."""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

from kubetrt.runtime import UnsupportedOpError, ops
from kubetrt.runtime.kernels import normalization
from kubetrt.runtime.kernels.registry import KernelSpec, lookup
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(11)
TOL = dict(rtol=1e-4, atol=1e-5)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def model(n: onnx.NodeProto, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray], opset: int = 17,
          dynamic_batch: bool = False) -> onnx.ModelProto:
    m = make_model([n], feeds, ["y"], consts, dynamic_batch=dynamic_batch)
    m.opset_import[0].version = opset
    if opset >= 21:
        m.ir_version = 10
    return m


def assert_matches(m: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: dict[str, float] = TOL) -> None:
    (ref,) = run_ort(m, feeds)
    for executor in ("sequential", "dataflow"):
        (got,) = run_kubetrt(m, feeds, executor)
        assert got.dtype == ref.dtype and got.shape == ref.shape, (executor, got.dtype, got.shape)
        np.testing.assert_allclose(got, ref, **tol, err_msg=executor)


@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 4, 5, 6), (1, 3, 3, 4, 5)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_instance_norm(shape: tuple[int, ...], eps: float) -> None:
    feeds = {"x": f32(*shape) * 3 + 1}
    n = node("InstanceNormalization", ["x", "s", "b"], epsilon=eps)
    assert_matches(model(n, feeds, {"s": f32(shape[1]), "b": f32(shape[1])}), feeds)


def test_instance_norm_defaults_runtime_scale_and_dynamic_batch() -> None:
    feeds = {"x": f32(3, 4, 5, 5), "s": f32(4), "b": f32(4)}
    assert_matches(model(node("InstanceNormalization", ["x", "s", "b"]), feeds, {}, dynamic_batch=True), feeds)


def test_instance_norm_float16_is_computed_in_float32() -> None:
    """Half inputs: statistics in float32, result rounded once to half (tolerance of half precision)."""
    feeds = {"x": (f32(2, 3, 8, 8) * 2).astype(np.float16)}
    consts = {"s": f32(3).astype(np.float16), "b": f32(3).astype(np.float16)}
    assert_matches(model(node("InstanceNormalization", ["x", "s", "b"]), feeds, consts), feeds, dict(rtol=2e-3, atol=2e-3))


# (id, num_groups, channels, spatial, opset): opset 18 scales per group, opset 21 per channel
GROUP_CASES = [
    ("g2_of_6_opset18", 2, 6, (5, 5), 18),
    ("g3_of_6_opset21", 3, 6, (4, 4), 21),
    ("g1_layernorm_like_opset18", 1, 4, (3, 5), 18),
    ("g1_opset21", 1, 4, (3, 5), 21),
    ("g_eq_c_instancenorm_like_opset21", 4, 4, (6,), 21),
    ("g2_5d_opset21", 2, 4, (2, 3, 4), 21),
    ("g4_of_8_1d_opset18", 4, 8, (9,), 18),
]


@pytest.mark.parametrize("case", GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_group_norm(case: tuple[str, int, int, tuple[int, ...], int]) -> None:
    _, groups, c, spatial, opset = case
    per = groups if opset < 21 else c
    feeds = {"x": f32(2, c, *spatial) * 2 - 1}
    n = node("GroupNormalization", ["x", "s", "b"], num_groups=groups, epsilon=1e-4)
    assert_matches(model(n, feeds, {"s": f32(per), "b": f32(per)}, opset), feeds)


def test_group_norm_runtime_scale_dynamic_batch_and_stash_type() -> None:
    feeds = {"x": f32(3, 6, 4, 4), "s": f32(6), "b": f32(6)}
    n = node("GroupNormalization", ["x", "s", "b"], num_groups=3, stash_type=1)
    assert_matches(model(n, feeds, {}, 21, dynamic_batch=True), feeds)


@pytest.mark.parametrize("op", ["InstanceNormalization", "GroupNormalization"])
def test_statistics_are_stable_on_a_large_mean(op: str) -> None:
    """Activations far from zero: a one-pass variance would lose every digit of the spread."""
    # its own generator: the module's is shared, so under pytest -n its draw would depend on which tests ran first
    x = (1e4 + np.random.default_rng(89).standard_normal((2, 4, 64, 64))).astype(np.float32)
    s, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    got = ops.call(op, x, s, b, **({"num_groups": 4} if op == "GroupNormalization" else {}))
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(axis=(2, 3), keepdims=True)) / np.sqrt(x64.var(axis=(2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)  # float32 inputs at 1e4 carry ~1e-3 absolute rounding


def test_group_norm_per_group_and_per_channel_agree_when_the_scale_is_repeated() -> None:
    x, s, b = f32(2, 6, 3, 3), f32(2), f32(2)
    per_group = ops.GroupNormalization(x, s, b, num_groups=2)
    per_channel = ops.GroupNormalization(x, np.repeat(s, 3), np.repeat(b, 3), num_groups=2)
    np.testing.assert_allclose(per_group, per_channel, rtol=1e-6, atol=1e-6)
    assert not np.allclose(per_group, ops.GroupNormalization(x, np.tile(s, 3), np.tile(b, 3), num_groups=2))


@pytest.mark.parametrize("inplace", [frozenset(), frozenset({0})])
@pytest.mark.parametrize("chunk", [1 << 18, 50])
def test_group_norm_chunks_and_overwrites_only_where_allowed(inplace: frozenset[int], chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are normalized in cache-sized chunks (tiny ones here); the input is overwritten only
    where the compiler says it dies here."""
    monkeypatch.setattr(normalization, "CHUNK_ELEMENTS", chunk)
    x, s, b = f32(3, 6, 5, 4), f32(6), f32(6)
    before = x.copy()
    spec = KernelSpec("GroupNormalization", "g", {"num_groups": 3}, [None] * 3, [x.shape, s.shape, b.shape], [x.dtype] * 3,
                      inplace=inplace, present=[True] * 3)
    (y,) = lookup("GroupNormalization").factory(spec)(x, s, b)
    xg = before.reshape(3, 3, -1).astype(np.float64)
    ref = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(y, ref * s[:, None, None] + b[:, None, None], **TOL)
    assert np.shares_memory(y, x) == bool(inplace)
    if not inplace:
        np.testing.assert_array_equal(x, before)


BAD = [
    ("InstanceNormalization", node("InstanceNormalization", ["x", "s", "b"], stash_type=1), {"x": f32(1, 2, 3)}, {"s": f32(2), "b": f32(2)},
     "attributes ['stash_type'] are not understood"),
    ("GroupNormalization", node("GroupNormalization", ["x", "s", "b"], num_groups=4), {"x": f32(1, 6, 3)}, {"s": f32(4), "b": f32(4)},
     "6 channels in 4 groups"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_attribute_is_refused_naming_the_node(case: tuple[str, onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray], str]) -> None:
    op, n, feeds, consts, given = case
    with pytest.raises(UnsupportedOpError, match=re.escape(f"node {n.name!r} ({op}): {given}") + ".*supported: "):
        run_kubetrt(make_model([n], feeds, ["y"], consts), feeds)


@pytest.mark.parametrize("attrs, shapes, given", [
    ({"num_groups": 2, "stash_type": 10}, [(1, 4, 3), (2,), (2,)], "stash_type=10"),
    ({"num_groups": 0}, [(1, 4, 3), (4,), (4,)], "num_groups=0"),
    ({"num_groups": 2}, [(1, 4, 3), (3,), (3,)], "scale of 3 values with 2 groups and 4 channels"),
    ({"num_groups": 2}, [(4, 3), (2,), (2,)], "a rank-2 input"),
])
def test_group_norm_refusals(attrs: dict[str, int], shapes: list[tuple[int, ...]], given: str) -> None:
    spec = KernelSpec("GroupNormalization", "gn", attrs, [None] * 3, list(shapes), [np.dtype(np.float32)] * 3, present=[True] * 3)
    with pytest.raises(UnsupportedOpError, match=re.escape(f"node 'gn' (GroupNormalization): {given}")):
        lookup("GroupNormalization").factory(spec)


def test_instance_norm_refuses_integer_inputs_and_mismatched_scale() -> None:
    spec = KernelSpec("InstanceNormalization", "in", {}, [None] * 3, [(1, 4, 3), (4,), (4,)], [np.dtype(np.int32)] * 3, present=[True] * 3)
    with pytest.raises(UnsupportedOpError, match=r"node 'in' \(InstanceNormalization\): input dtype int32"):
        lookup("InstanceNormalization").factory(spec)
    spec.dtypes = [np.dtype(np.float32)] * 3
    spec.shapes = [(1, 4, 3), (3,), (4,)]
    with pytest.raises(UnsupportedOpError, match="scale of 3 values for 4 channels"):
        lookup("InstanceNormalization").factory(spec)


@pytest.mark.parametrize("op", ["InstanceNormalization", "GroupNormalization"])
def test_shape_functions_take_unknown_shapes(op: str) -> None:
    spec = KernelSpec(op, "s", {"num_groups": 2}, [None] * 3, [None] * 3, [None] * 3, present=[True] * 3)
    assert lookup(op).shape_fn(spec) == [(None, None)]
    spec.shapes, spec.dtypes = [(-1, 4, -1), (4,), (4,)], [np.dtype(np.float32)] * 3
    assert lookup(op).shape_fn(spec) == [((-1, 4, -1), np.dtype(np.float32))]
