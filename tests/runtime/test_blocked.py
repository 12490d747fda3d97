"""passes/blocked.py: regions of oneDNN convolutions and pools pass blocked tensors from
BLOCKED_MIN_BATCH images up and NHWC ones below it; every case runs against onnxruntime on the
model as written, at a batch on each side of the threshold."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.kernels import onednn
from kubetrt.runtime.onnx_import import from_proto
from onnx_cases import make_model, node, run_ort, run_plan

pytestmark = [pytest.mark.skipif(not onednn.AVAILABLE, reason="oneDNN is a base dependency; without it no region forms"),
              pytest.mark.usefixtures("blocked_from_8")]

rng = np.random.default_rng(5)
SMALL, LARGE = 1, 8  # each side of the threshold the blocked_from_8 fixture sets
BLOCKS = 16 // onednn.BLOCK  # the test nets' 16 channels, in blocks


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# 3x3 weights over 16 channels are scaled by 0.1 (about 1/sqrt(fan-in), as trained ones are):
# unit weights grow activations to hundreds, where Winograd's rounding alone passes the fp32 tolerance


def run_observed(model: Any, x: np.ndarray) -> tuple[list[np.ndarray], dict[str, tuple[int, ...]]]:
    """The plan's outputs, and the shape of what each kernel returned (op -> last shape seen)."""
    seen: dict[str, tuple[int, ...]] = {}

    def on_step(op: str, args: tuple[Any, ...], out: tuple[np.ndarray, ...]) -> None:
        seen[op] = np.shape(out[0])

    outputs, _ = run_plan(model, {"x": x}, on_step)
    return outputs, seen


def check(model: Any, batch: int) -> dict[str, tuple[int, ...]]:
    x = f32(batch, 16, 12, 12)
    got, seen = run_observed(model, x)
    for g, want in zip(got, run_ort(model, {"x": x})):
        assert g.shape == want.shape
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)
    return seen


def residual_net(extra_output: bool = False) -> Any:
    # conv-relu -> maxpool -> depthwise -> 1x1 conv + shortcut -> relu -> 1x1 conv -> global pool
    nodes = [node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), node("Relu", ["c1"], ["r1"]),
             node("MaxPool", ["r1"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             node("Conv", ["p", "wd"], ["d"], pads=[1, 1, 1, 1], group=16),
             node("Conv", ["d", "w2"], ["c2"]), node("Add", ["c2", "p"], ["s"]), node("Relu", ["s"], ["r2"]),
             node("Conv", ["r2", "w3"], ["c3"]), node("GlobalAveragePool", ["c3"], ["y"])]
    outputs = ["y"] + (["r2"] if extra_output else [])
    consts = {"w1": f32(16, 16, 3, 3) * 0.1, "b1": f32(16), "wd": f32(16, 1, 3, 3), "w2": f32(16, 16, 1, 1), "w3": f32(16, 16, 1, 1)}
    return make_model(nodes, {"x": f32(1, 16, 12, 12)}, outputs, consts, dynamic_batch=True)


def test_a_region_runs_blocked_from_the_threshold_and_nhwc_below_it() -> None:
    model = residual_net()
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert ops.count("ToBlocked") == 1 and "FromBlocked" not in ops, ops  # the global pool leaves the region itself
    large = check(model, LARGE)
    assert large["ToBlocked"] == (LARGE, BLOCKS, 12, 12, onednn.BLOCK)
    assert large["FusedConvNHWC"] == (LARGE, BLOCKS, 6, 6, onednn.BLOCK)  # the last conv of the region
    assert large["GlobalAveragePoolNHWC"] == (LARGE, 1, 1, 16)
    small = check(model, SMALL)
    assert small["ToBlocked"] == (SMALL, 12, 12, 16) and small["FusedConvNHWC"] == (SMALL, 6, 6, 16)


def test_a_value_read_outside_the_region_leaves_it_as_nhwc() -> None:
    model = residual_net(extra_output=True)
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert ops.count("ToBlocked") == 1 and ops.count("FromBlocked") == 1, ops
    seen = check(model, LARGE)
    assert seen["FromBlocked"] == (LARGE, 6, 6, 16)


def test_a_region_that_would_reorder_more_than_it_computes_stays_nhwc() -> None:
    # every convolution's output is also a graph output: three exits for two convolutions
    nodes = [node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Conv", ["c1", "w2"], ["c2"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, {"x": f32(1, 16, 12, 12)}, ["c1", "c2"], {"w1": f32(16, 16, 3, 3) * 0.1, "w2": f32(16, 16, 3, 3) * 0.1},
                       dynamic_batch=True)
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert "ToBlocked" not in ops and "FromBlocked" not in ops, ops
    assert check(model, LARGE)["FusedConvNHWC"] == (LARGE, 12, 12, 16)


def test_channels_that_do_not_fill_blocks_stay_nhwc() -> None:
    nodes = [node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Conv", ["c1", "w2"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, {"x": f32(1, 16, 12, 12)}, ["y"], {"w1": f32(12, 16, 3, 3) * 0.1, "w2": f32(16, 12, 3, 3)},
                       dynamic_batch=True)
    assert "ToBlocked" not in [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    check(model, LARGE)


def test_reorders_round_trip_exactly_and_name_a_bad_input() -> None:
    x = f32(3, 5, 7, 3 * onednn.BLOCK)
    blocked = onednn.Reorder(to_blocked=True)(x)
    assert blocked.shape == (3, 3, 5, 7, onednn.BLOCK)
    np.testing.assert_array_equal(blocked, x.reshape(3, 5, 7, 3, onednn.BLOCK).transpose(0, 3, 1, 2, 4))
    np.testing.assert_array_equal(onednn.Reorder(to_blocked=False)(blocked), x)
    with pytest.raises(ValueError, match=rf"channels in blocks of {onednn.BLOCK}.*shape \[3, 5, 7, 20\]"):
        onednn.Reorder(to_blocked=True)(f32(3, 5, 7, 20))


def test_the_block_follows_the_instruction_set_unless_set_and_a_bad_value_is_named() -> None:
    avx2, avx512_core = 0x7, 0x27  # oneDNN's dnnl_cpu_isa_t values
    assert onednn.channel_block({}, avx2) == 8 and onednn.channel_block({}, avx512_core) == 16
    assert onednn.channel_block({onednn.BLOCK_ENV: " 8 "}, avx512_core) == 8
    with pytest.raises(ValueError, match="KUBETRT_CHANNEL_BLOCK='12': expected 8 or 16 channels per block"):
        onednn.channel_block({onednn.BLOCK_ENV: "12"}, avx2)


@pytest.mark.skipif(bool(os.environ.get(onednn.BLOCK_ENV)), reason="this process already runs the other block size")
def test_the_regions_also_run_in_the_other_block_size() -> None:
    """This machine's instruction set picks one block size; the other is what a machine with the
    other picks: the region tests run again in a process that uses it."""
    other = "8" if onednn.BLOCK == 16 else "16"
    tests = "region_runs or squeeze_excitation_gate or stem_convolution_writes or read_outside or more_channels"
    code = ("import sys, pytest\nfrom kubetrt.runtime.kernels import onednn\nprint('block', onednn.BLOCK)\n"
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', {tests!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, onednn.BLOCK_ENV: other}, capture_output=True, text=True)
    assert proc.returncode == 0 and f"block {other}\n" in proc.stdout and re.search(r"\b6 passed", proc.stdout), \
        proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize(("text", "expected"), [("", onednn.NEVER), ("16", 16), ("1", 1)])
def test_blocked_min_batch_from_env_else_never(text: str, expected: int) -> None:
    assert onednn.blocked_min_batch({onednn.BLOCKED_ENV: text}) == expected


def test_blocked_min_batch_zero_means_never_and_junk_is_an_error() -> None:
    assert onednn.blocked_min_batch({onednn.BLOCKED_ENV: "0"}) == onednn.NEVER
    with pytest.raises(ValueError, match="KUBETRT_BLOCKED_MIN_BATCH='eight': expected a batch size"):
        onednn.blocked_min_batch({onednn.BLOCKED_ENV: "eight"})


def test_a_squeeze_excitation_gate_scales_the_blocks_in_the_region() -> None:
    # conv -> depthwise -> [global pool -> 1x1 conv -> sigmoid] -> gate * depthwise -> 1x1 conv -> conv
    nodes = [node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), node("Conv", ["c1", "wd"], ["d"], pads=[1, 1, 1, 1], group=16),
             node("GlobalAveragePool", ["d"], ["g"]), node("Conv", ["g", "ws"], ["e"]), node("Sigmoid", ["e"], ["gate"]),
             node("Mul", ["gate", "d"], ["m"]), node("Conv", ["m", "w2"], ["c2"]),
             node("Conv", ["c2", "w3"], ["c3"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["c3"], ["y"])]
    consts = {"w1": f32(16, 16, 3, 3) * 0.1, "wd": f32(16, 1, 3, 3), "ws": f32(16, 16, 1, 1), "w2": f32(16, 16, 1, 1), "w3": f32(16, 16, 3, 3) * 0.1}
    model = make_model(nodes, {"x": f32(1, 16, 12, 12)}, ["y"], consts, dynamic_batch=True)
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert ops.count("ToBlocked") == 1 and "FromBlocked" not in ops, ops
    assert check(model, LARGE)["Mul"] == (LARGE, BLOCKS, 12, 12, onednn.BLOCK)
    assert check(model, SMALL)["Mul"] == (SMALL, 12, 12, 16)


def test_scale_blocked_matches_broadcasting_and_names_bad_shapes() -> None:
    from kubetrt.runtime.kernels import jit

    if not jit.AVAILABLE:
        pytest.skip("numba is a base dependency; without it Mul never joins a region")
    for b in (8, 16):
        x, g = f32(3, 2, 4, 5, b), f32(3, 1, 1, 2 * b)
        np.testing.assert_array_equal(jit.scale_blocked(x, g, np.empty_like(x)), x * g.reshape(3, 2, 1, 1, b))
    with pytest.raises(ValueError, match=r"scale_blocked: .* got \[3, 2, 4, 5, 16\] and \[3, 1, 1, 24\]"):
        jit.scale_blocked(x, f32(3, 1, 1, 24), np.empty_like(x))
    with pytest.raises(ValueError, match=r"B 8 or 16.* got \[3, 2, 4, 5, 4\]"):
        jit.scale_blocked(f32(3, 2, 4, 5, 4), f32(3, 1, 1, 8), np.empty((3, 2, 4, 5, 4), np.float32))


def stem_net(stem_read_outside: bool = False, stem_residual: bool = False, channels: int = 3) -> Any:
    # an image's three channels -> 16: the stem cannot read blocks, but the region after it can
    nodes = [node("Conv", ["img", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1], strides=[2, 2]), node("Relu", ["c0"], ["stem"]),
             node("Conv", ["stem", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), node("Relu", ["c1"], ["r1"]),
             node("Conv", ["r1", "w2"], ["c2"]), node("GlobalAveragePool", ["c2"], ["y"])]
    outputs = ["y"] + (["stem"] if stem_read_outside else [])
    consts = {"w0": f32(16, channels, 3, 3), "b0": f32(16), "w1": f32(16, 16, 3, 3) * 0.1, "b1": f32(16), "w2": f32(16, 16, 1, 1)}
    return make_model(nodes, {"img": f32(1, channels, 14, 14)}, outputs, consts, dynamic_batch=True)


def run_stem(model: Any, batch: int, channels: int = 3) -> tuple[dict[str, tuple[int, ...]], list[tuple[int, ...]]]:
    img = f32(batch, channels, 14, 14)
    convs: list[tuple[int, ...]] = []
    seen: dict[str, tuple[int, ...]] = {}

    def on_step(op: str, args: tuple[Any, ...], out: tuple[np.ndarray, ...]) -> None:
        seen[op] = np.shape(out[0])
        if op == "FusedConvNHWC":
            convs.append(np.shape(out[0]))
    got, _ = run_plan(model, {"img": img}, on_step)
    for g, want in zip(got, run_ort(model, {"img": img})):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)
    return seen, convs


def test_the_stem_convolution_writes_the_regions_blocks_itself() -> None:
    model = stem_net()
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert "ToBlocked" not in ops and ops.count("FusedConvNHWC") == 3, ops
    seen, convs = run_stem(model, LARGE)
    assert convs[0] == (LARGE, BLOCKS, 7, 7, onednn.BLOCK) and convs[1] == (LARGE, BLOCKS, 7, 7, onednn.BLOCK), convs
    assert seen["GlobalAveragePoolNHWC"] == (LARGE, 1, 1, 16)
    _, convs = run_stem(model, SMALL)
    assert convs[0] == (SMALL, 7, 7, 16), convs  # below the threshold the whole region stays NHWC


def test_a_stem_whose_result_is_read_outside_the_region_keeps_its_reorder() -> None:
    model = stem_net(stem_read_outside=True)
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert ops.count("ToBlocked") == 1, ops
    _, convs = run_stem(model, LARGE)
    assert convs[0] == (LARGE, 7, 7, 16), convs


def test_a_convolution_of_more_channels_than_a_block_keeps_its_reorder() -> None:
    """Blocks from NHWC input channels that do not fill them are oneDNN's reference code, three orders
    of magnitude slower than the reorder: only a first convolution (fewer channels than a block) writes them."""
    channels = onednn.BLOCK + onednn.BLOCK // 2
    model = stem_net(channels=channels)
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert ops.count("ToBlocked") == 1, ops
    _, convs = run_stem(model, LARGE, channels)
    assert convs[0] == (LARGE, 7, 7, 16) and convs[1] == (LARGE, BLOCKS, 7, 7, onednn.BLOCK), convs


def test_blocked_out_names_what_it_cannot_do() -> None:
    w = f32(12, 3, 3, 3)
    conv = onednn.Conv2D(w, None, 1, [1, 1], [1, 1], None, residual=False)
    with pytest.raises(ValueError, match=f"a blocked result needs output channels in blocks of {onednn.BLOCK}, got 12"):
        conv(f32(8, 5, 5, 3), 5, 5, [1, 1], [1, 1], blocked_out=True)


def test_where_no_batch_takes_the_layout_no_region_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "BLOCKED_MIN_BATCH", onednn.NEVER)  # the default
    model = residual_net()
    ops = [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]
    assert "ToBlocked" not in ops and "FromBlocked" not in ops, ops
    assert check(model, LARGE)["FusedConvNHWC"] == (LARGE, 6, 6, 16)
