"""Bands: a chain's runs of convolutions and poolings at batch 1 cut into bands of image rows, each
run whole by one team member (runtime/kernels/bands.py). Watched by what they change: the captured
chain runs the run as one band call, and its results stay the uncut chain's and onnxruntime's
(fp32 tolerance from the one table, runtime/accuracy.py) for strides, dilations, padding on either
edge, asymmetric padding, max and average pooling, and more bands than team members."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.executor import SequentialPlan
from kubetrt.runtime.kernels import bands, omp, onednn, primitive_chain
from kubetrt.runtime.kernels.buffers import whole_lines
from kubetrt.runtime.kernels.primitive_chain import ARENA, INPUT, RESULT, Buffer, KernelCall, PrimitiveChain, Row
from kubetrt.runtime.onnx_import import from_proto
from onnx_cases import make_model, node, run_ort
import two_ways

pytestmark = pytest.mark.skipif(not bands.AVAILABLE, reason="bands need the onednn extra, numba and libgomp")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(41)
RELU = ("eltwise_relu", 0.0, 0.0)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def band_calls(rows: list[Row]) -> list[Row]:
    return [row for row in rows if isinstance(row.step, KernelCall) and row.step.entry == bands.jit.entry_address(bands._member)]


# --- the geometry: which input rows each band's layers read ---------------------------------------

GEOMETRIES = {  # (h, kernel, stride, dilation, pad_top, pad_bottom) per layer, first to last
    "3x3 twice": [(32, 3, 1, 1, 1, 1), (32, 3, 1, 1, 1, 1)],
    "stride 2, SAME's bottom pad": [(33, 3, 2, 1, 0, 1), (17, 3, 1, 1, 1, 1)],
    "dilated": [(20, 3, 1, 2, 2, 2), (20, 1, 1, 1, 0, 0)],
    "pool 2x2": [(32, 3, 1, 1, 1, 1), (32, 2, 2, 1, 0, 0), (16, 3, 1, 1, 1, 1)],
    "5x5, no pad": [(24, 5, 1, 1, 0, 0), (20, 3, 2, 1, 0, 0)],
}


def layers_of(geometry: list[tuple[int, ...]]) -> list[onednn.Rows]:
    out = []
    for h, k, s, d, pt, pb in geometry:
        oh = (h + pt + pb - (k - 1) * d - 1) // s + 1
        out.append(onednn.Rows(h, oh, k, s, d, pt, 64, 64, 1))
    return out


@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("count", [2, 3])
def test_bands_split_the_result_rows_and_read_inside_the_image(name: str, count: int) -> None:
    layers = layers_of(GEOMETRIES[name])
    cuts = bands.plan(layers, count)
    assert cuts is not None
    # the last layer's rows, split once each among the bands in order
    assert [r for band in cuts for r in range(band[-1].oh)] and sum(band[-1].oh for band in cuts) == layers[-1].oh
    for band in cuts:
        for k, (cut, rows) in enumerate(zip(band, layers)):
            assert 0 <= cut.first and cut.first + cut.ih <= rows.h
            assert 0 <= cut.pad_top <= rows.pad_top
            reach = (rows.kernel - 1) * rows.dilation + 1
            assert (cut.ih + cut.pad_top + cut.pad_bottom - reach) // rows.stride + 1 == cut.oh  # oneDNN's shape rule
            if k:  # a layer reads exactly the rows the one before computed
                assert band[k - 1].oh == cut.ih


def test_too_few_rows_are_not_cut() -> None:
    assert bands.plan(layers_of([(3, 3, 1, 1, 1, 1), (3, 3, 1, 1, 1, 1)]), 2) is None
    assert bands.plan(layers_of(GEOMETRIES["3x3 twice"]), 1) is None


def test_the_cost_model_cuts_short_layers_and_keeps_long_few_row_ones_whole() -> None:
    def layer(h: int, cin: int, cout: int, k: int) -> onednn.Rows:
        return onednn.Rows(h, h, k, 1, 1, k // 2, h * cin * 4, h * cout * 4, h * cout * cin * k * k)
    small = [layer(32, 3, 16, 3), layer(32, 16, 32, 3)]  # a small CNN's stem: a few microseconds each
    cuts = bands.plan(small, 2)
    assert cuts is not None and bands.gain_us(small, cuts) > 0
    late = [layer(7, 2048, 512, 1), layer(7, 512, 512, 3)]  # ResNet-50's last stage: 3 and 4 rows, milliseconds of work
    cuts = bands.plan(late, 2)
    assert cuts is not None and bands.gain_us(late, cuts) < 0


# --- a chain of real convolutions, cut and uncut ----------------------------------------------------

def conv(cin: int, cout: int, k: int, stride: int, h: int, dil: int = 1, group: int = 1,
         pads: tuple[int, int] | None = None) -> tuple[onednn.Site, int]:
    op = onednn.Conv2D(f32(cout, cin // group, k, k) * 0.2, f32(cout), group, [stride, stride], [dil, dil], RELU, False)
    pt, pb = pads if pads is not None else ((k - 1) * dil // 2, (k - 1) * dil // 2)
    oh = (h + pt + pb - (k - 1) * dil - 1) // stride + 1
    return op.bind((1, h, h, cin), oh, oh, [pt, pt], [pb, pb]), oh  # type: ignore[return-value]


def pool(c: int, h: int, algorithm: str = "pooling_max", k: int = 2, stride: int = 2, pad: int = 0) -> tuple[onednn.Site, int]:
    oh = (h + 2 * pad - k) // stride + 1
    return onednn.Pool2D(algorithm, (k, k), [stride, stride], [1, 1]).bind((1, h, h, c), oh, oh, [pad, pad], [pad, pad]), oh


def stack(h: int, cin: int, layers: list[tuple[str, tuple[Any, ...]]]) -> list[onednn.Site]:
    sites, c = [], cin
    for kind, args in layers:
        if kind == "conv":
            cout, k, stride, *rest = args
            site, h = conv(c, cout, k, stride, h, *rest)
            c = cout
        else:
            site, h = pool(c, h, *args)
        sites.append(site)
    return sites


def chain_of(sites: list[onednn.Site], x_shape: tuple[int, ...], count: int | None) -> PrimitiveChain:
    """The chain a capture would make of these layers in a row; `count` bands for its team (None: uncut)."""
    buffers, offset = [Buffer(INPUT, 0, x_shape, np.dtype(np.float32))], 0
    for site in sites[:-1]:
        buffers.append(Buffer(ARENA, offset, site.shape, np.dtype(np.float32)))
        offset += whole_lines(int(np.prod(site.shape)) * 4)
    buffers.append(Buffer(RESULT, 0, sites[-1].shape, np.dtype(np.float32)))
    rows = [Row(site, i, i + 1) for i, site in enumerate(sites)]
    team = None if count is None else bands.team_rows(rows, buffers, [len(sites)], count)

    def unused(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
        raise AssertionError("the chain fell back")
    return PrimitiveChain(rows, buffers, [(len(sites), sites[-1].shape)], max(offset, 1), unused, "test", team)


STACKS = {
    "small CNN": (32, 3, [("conv", (16, 3, 1)), ("conv", (32, 3, 1)), ("pool", ()), ("conv", (32, 3, 1, 1, 32)), ("conv", (64, 1, 1))]),
    "stride 2 with SAME's bottom pad": (33, 8, [("conv", (16, 3, 2, 1, 1, (0, 1))), ("conv", (16, 3, 1)), ("conv", (24, 1, 1))]),
    "dilated": (24, 8, [("conv", (16, 3, 1, 2)), ("conv", (16, 3, 1, 2)), ("conv", (8, 1, 1))]),
    "average pools": (28, 8, [("conv", (16, 3, 1)), ("pool", ("pooling_avg_include_padding", 3, 1, 1)),
                              ("pool", ("pooling_avg_exclude_padding", 3, 2, 1)), ("conv", (16, 3, 1))]),
    "odd rows": (19, 4, [("conv", (8, 5, 1)), ("conv", (8, 3, 1)), ("conv", (8, 3, 2))]),
}


@pytest.fixture
def always_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run that plan() can cut is cut: these tests are about results, not the cost model."""
    monkeypatch.setattr(bands, "HAND_OFF_US", 1e9)


@pytest.mark.parametrize("name", STACKS)
@pytest.mark.parametrize("count", [2, 3])
def test_a_cut_chain_gives_the_uncut_chain_s_results(name: str, count: int, always_cut: None) -> None:
    h, cin, layers = STACKS[name]
    sites = stack(h, cin, layers)
    x = f32(1, h, h, cin)
    cut, whole = chain_of(sites, x.shape, count), chain_of(sites, x.shape, None)
    (call,) = band_calls(cut.team_rows)  # the whole run is one team call
    assert len(cut.team_rows) == 1
    want = whole(x)[0]
    ref = x
    for site in sites:  # each layer on its own, one primitive call each
        ref = site(ref)
    np.testing.assert_allclose(want, ref, rtol=TOL.rtol, atol=TOL.atol)
    # the team's table, where the bands run (with three bands, more than this machine's members:
    # they take turns); then through the chain's call, as its team choice picks
    np.testing.assert_allclose(bands_only(cut, x), want, rtol=TOL.rtol, atol=TOL.atol)
    for _ in range(3):
        np.testing.assert_allclose(cut(x)[0], want, rtol=TOL.rtol, atol=TOL.atol)


def drive_bands(choice: primitive_chain.BandsChoice, bands_s: float, layers_s: float, calls: int) -> list[bool]:
    """Whether each call ran layer by layer."""
    return two_ways.drive(choice, bands_s, layers_s, calls)


def test_the_bands_choice_follows_the_faster_way_and_keeps_exploring() -> None:
    BandsChoice = primitive_chain.BandsChoice
    choice = BandsChoice()
    first = drive_bands(choice, bands_s=1.2e-3, layers_s=1e-3, calls=BandsChoice.FILL * (BandsChoice.SAMPLES + 1))
    assert 0 < sum(first) < len(first) and choice.layers, "both ways are tried, and the faster taken"
    slower_bands = drive_bands(choice, bands_s=1.2e-3, layers_s=1e-3, calls=320)
    assert len(slower_bands) - sum(slower_bands) == 2 * 320 // BandsChoice.EXPLORE, "layer by layer runs, bands are tried two calls at a time"
    drive_bands(choice, bands_s=0.5e-3, layers_s=1e-3, calls=BandsChoice.EXPLORE)  # one lucky try in bands moves nothing
    assert choice.layers
    faster_bands = drive_bands(choice, bands_s=0.8e-3, layers_s=1e-3, calls=8 * BandsChoice.EXPLORE)
    assert sum(faster_bands[-2 * BandsChoice.EXPLORE:]) <= 4, "bands are taken back once they are faster"


def test_a_try_is_judged_against_the_calls_just_before_it() -> None:
    """The machine speeds up fourfold while bands run (a neighbour leaves): tries layer by layer,
    each 10% slower than the bands beside them, are not taken for faster than the bands' old times."""
    choice = primitive_chain.BandsChoice()
    drive_bands(choice, bands_s=4.0e-3, layers_s=4.4e-3, calls=4 * choice.EXPLORE)
    assert not choice.layers
    fast = drive_bands(choice, bands_s=1.0e-3, layers_s=1.1e-3, calls=8 * choice.EXPLORE)
    assert not choice.layers and sum(fast) == 2 * len(fast) // choice.EXPLORE


def test_the_first_call_after_a_switch_is_not_counted() -> None:
    """It finds the other way's data cold. Counted, tries of layer by layer (2% faster here) would
    read slower than the bands, and the bands would stay."""
    choice = primitive_chain.BandsChoice()
    for _ in range(choice.FILL * (choice.SAMPLES + 1)):
        layers = choice.pick()
        cold = 0.2e-3 if choice.switched else 0.0
        choice.record(layers, (0.98e-3 if layers else 1.0e-3) + cold)
    assert choice.layers


def test_a_chain_whose_bands_run_slower_runs_its_layers_on_the_team(always_cut: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's own call follows its times: here a clock of its own, on which a call in bands
    takes twice as long as one layer by layer (a real one would let this machine's load decide).
    Later calls run the team's layer-by-layer table, with the same results."""
    h, cin, layers = STACKS["small CNN"]
    sites = stack(h, cin, layers)
    x = f32(1, h, h, cin)
    cut = chain_of(sites, x.shape, 2)
    assert cut.bands is not None and chain_of(sites, x.shape, None).bands is None
    want = cut(x)[0]
    ran: list[str] = []
    run_rows = primitive_chain._run_rows
    banded = primitive_chain._Arena(cut).table(primitive_chain.BANDS)
    clock = [0.0]

    def timed_rows(table: np.ndarray, *args: Any) -> int:
        in_bands = table.shape == banded.shape and bool((table[:, 0] == banded[:, 0]).all())
        ran.append("bands" if in_bands else "layers")
        clock[0] += 2e-3 if in_bands else 1e-3
        return run_rows(table, *args)

    def team(choice: omp.TeamChoice) -> bool:  # every call on the team (where bands or layers is chosen), each timed
        choice.calls += 1
        return False
    monkeypatch.setattr(primitive_chain, "_run_rows", timed_rows)
    monkeypatch.setattr(primitive_chain, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(omp.TeamChoice, "pick", team)
    monkeypatch.setattr(omp.TeamChoice, "untimed", lambda choice: False)
    for _ in range(64):
        np.testing.assert_allclose(cut(x)[0], want, rtol=TOL.rtol, atol=TOL.atol)
    assert cut.bands.layers
    assert "bands" in ran[:16] and "layers" in ran[:16], "both ways are timed first"
    assert ran[-32:].count("layers") >= 30, ran


def bands_only(chain: PrimitiveChain, x: np.ndarray) -> np.ndarray:
    """The chain's team table run directly, whatever its team choice would pick."""
    arena = primitive_chain._Arena(chain)
    out = np.full(chain.results[0][0], np.nan, np.float32)
    status = primitive_chain._run_rows(arena.table(primitive_chain.BANDS), arena.ptrs, (x,), (out,))
    assert status == 0
    return out


# --- in a plan: captured chains at batch 1 ----------------------------------------------------------

def small_cnn() -> Any:
    """Conv-ReLU, Conv-ReLU, max pool, depthwise Conv-ReLU, 1x1 Conv summed onto the pool's
    output, global average: the pool's result is read twice, so a run of bands ends there."""
    nodes = [node("Conv", ["x", "w0"], ["a0"], pads=[1, 1, 1, 1]), node("Relu", ["a0"], ["a"]),
             node("Conv", ["a", "w1"], ["b0"], pads=[1, 1, 1, 1]), node("Relu", ["b0"], ["b"]),
             node("MaxPool", ["b"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             node("Conv", ["p", "w2"], ["d0"], pads=[1, 1, 1, 1], group=32), node("Relu", ["d0"], ["d"]),
             node("Conv", ["d", "w3"], ["e"]), node("Add", ["e", "p"], ["s"]), node("GlobalAveragePool", ["s"], ["g"])]
    # 8 channels between the first two convolutions: fewer than Winograd's form takes, so both run in bands
    consts = {"w0": f32(8, 3, 3, 3) * 0.3, "w1": f32(32, 8, 3, 3) * 0.2, "w2": f32(32, 1, 3, 3) * 0.3, "w3": f32(32, 32, 1, 1) * 0.2}
    return make_model(nodes, {"x": f32(1, 3, 32, 32)}, ["g"], consts, dynamic_batch=True)


def captured(model: Any, x: np.ndarray) -> tuple[PrimitiveChain, list[np.ndarray], list[Row]]:
    """The model's one chain, captured for x by the first of four plan runs; the runs' results;
    the chain's rows its team runs in band calls."""
    plan = RUNTIME.prepare(from_proto(model), {})
    assert isinstance(plan, SequentialPlan)
    got = [plan.run([x])[0] for _ in range(4)]
    (chain,) = [run for run, *_ in plan.captured_steps([x]) or [] if isinstance(run, PrimitiveChain)]
    return chain, got, [row for row in chain.rows if row.step not in [r.step for r in chain.team_rows]]


def test_a_plan_at_batch_1_runs_its_layers_in_bands_with_onnxruntime_s_results() -> None:
    model = small_cnn()
    x = f32(1, 3, 32, 32)
    chain, got, cut = captured(model, x)
    first = band_calls(chain.team_rows)[0]
    assert [row.step.op.kind for row in cut[:3]] == ["Conv", "Conv", "Pool"]  # type: ignore[union-attr]
    assert first.src == cut[0].src and first.dst == cut[2].dst
    want = run_ort(model, {"x": x})[0]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=TOL.rtol, atol=TOL.atol)
    np.testing.assert_allclose(bands_only_plan(chain, x), np.asarray(got[-1]).reshape(-1), rtol=TOL.rtol, atol=TOL.atol)


def bands_only_plan(chain: PrimitiveChain, x: np.ndarray) -> np.ndarray:
    """A captured chain's team table run directly on x (in the plan's layout)."""
    arena = primitive_chain._Arena(chain)
    xs = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if chain.expect[0][0] != x.shape else x,)
    results = tuple(np.empty(shape, dtype) for shape, dtype in chain.results)
    assert primitive_chain._run_rows(arena.table(primitive_chain.BANDS), arena.ptrs, xs, results) == 0
    return results[0].reshape(-1)


def test_batches_of_more_than_one_image_are_not_cut() -> None:
    chain, _, _ = captured(small_cnn(), f32(2, 3, 32, 32))
    assert band_calls(chain.team_rows) == [] and chain.team_rows == chain.rows


def test_the_switch_turns_bands_off() -> None:
    assert bands.bands_enabled({}) and not bands.bands_enabled({bands.BANDS_ENV: "0"})
    with pytest.raises(ValueError, match="KUBETRT_ROW_BANDS='yes': expected 1"):
        bands.bands_enabled({bands.BANDS_ENV: "yes"})


def inverted_residual() -> Any:
    """A MobileNetV2 block: its input made by a stem convolution, 1x1 expand, depthwise, 1x1
    project summed onto the block's input; then a 3x3 convolution and the global average."""
    nodes = [node("Conv", ["x", "w0"], ["s0"], pads=[1, 1, 1, 1]), node("Relu", ["s0"], ["s"]),
             node("Conv", ["s", "w1"], ["a0"]), node("Relu", ["a0"], ["a"]),
             node("Conv", ["a", "w2"], ["b0"], pads=[1, 1, 1, 1], group=96), node("Relu", ["b0"], ["b"]),
             node("Conv", ["b", "w3"], ["c"]), node("Add", ["c", "s"], ["d"]),
             node("Conv", ["d", "w4"], ["e"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["e"], ["g"])]
    consts = {"w0": f32(16, 3, 3, 3) * 0.3, "w1": f32(96, 16, 1, 1) * 0.2, "w2": f32(96, 1, 3, 3) * 0.3, "w3": f32(16, 96, 1, 1) * 0.1,
              "w4": f32(16, 16, 3, 3) * 0.2}
    return make_model(nodes, {"x": f32(1, 3, 56, 56)}, ["g"], consts, dynamic_batch=True)


def test_a_residual_sum_ends_a_band_run_and_lands_once_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    model = inverted_residual()
    x = f32(1, 3, 56, 56)
    chain, got, cut = captured(model, x)
    (call,) = band_calls(chain.team_rows)
    # expand, depthwise, project: the 3x3 after the sum is not cut with them (its bands' overlap
    # would have the sum computed twice on the rows at the cut)
    assert [row.step.op.residual for row in cut] == [False, False, True]  # type: ignore[union-attr]
    assert call.dst == cut[-1].dst
    want = run_ort(model, {"x": x})[0]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=TOL.rtol, atol=TOL.atol)
    # one member running the bands in turn: a band that wrote rows a later band still reads shows
    # every time, not only when the members' timing has it
    monkeypatch.setattr(omp, "TEAM", 1)
    np.testing.assert_allclose(bands_only_plan(chain, x), want.reshape(-1), rtol=TOL.rtol, atol=TOL.atol)


def test_layers_ending_in_swish_are_not_cut(always_cut: None) -> None:
    x_shape = (1, 32, 32, 8)
    swish = ("eltwise_swish", 1.0, 0.0)
    sites = [onednn.Conv2D(f32(16, 8, 1, 1), f32(16), 1, [1, 1], [1, 1], act, False).bind(x_shape, 32, 32, [0, 0], [0, 0])
             for act in (swish, RELU)]
    chain = chain_of([sites[0], conv(16, 16, 3, 1, 32)[0]], x_shape, 2)
    assert band_calls(chain.team_rows) == []
    chain = chain_of([sites[1], conv(16, 16, 3, 1, 32)[0]], x_shape, 2)
    assert len(band_calls(chain.team_rows)) == 1


def test_long_layers_are_cut_only_for_a_share_of_their_time() -> None:
    # a 3x3 then a 1x1: no rows computed twice, so the hand-off is all the model weighs; at
    # ResNet-50's widths the layers take near a millisecond, and a few microseconds saved is noise
    def pair(c: int) -> PrimitiveChain:
        x_shape = (1, 28, 28, c)
        return chain_of([conv(c, c, 3, 1, 28)[0], conv(c, 4 * c, 1, 1, 28)[0]], x_shape, 2)
    assert len(band_calls(pair(32).team_rows)) == 1
    assert band_calls(pair(128).team_rows) == []


def test_a_run_whose_result_the_arena_places_over_its_source_reads_all_of_it_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # The arena is planned for the rows one after another: a run's source is dead once its first
    # layer has read it, so the run's result may take its bytes (here, all of them), where a band
    # call has one band's last layer writing rows another band's first layer still reads.
    x_shape, f = (1, 32, 32, 8), np.dtype(np.float32)
    swish = ("eltwise_swish", 1.0, 0.0)  # a layer no band takes: the run is the two between, arena to arena
    first = onednn.Conv2D(f32(16, 8, 1, 1), f32(16), 1, [1, 1], [1, 1], swish, False).bind(x_shape, 32, 32, [0, 0], [0, 0])
    last = onednn.Conv2D(f32(8, 16, 1, 1), f32(8), 1, [1, 1], [1, 1], swish, False).bind((1, 32, 32, 16), 32, 32, [0, 0], [0, 0])
    sites = [first, conv(16, 16, 3, 1, 32)[0], conv(16, 16, 3, 1, 32)[0], last]
    inner = whole_lines(32 * 32 * 16 * 4)
    buffers = [Buffer(INPUT, 0, x_shape, f), Buffer(ARENA, 0, sites[0].shape, f), Buffer(ARENA, inner, sites[1].shape, f),
               Buffer(ARENA, 0, sites[2].shape, f), Buffer(RESULT, 0, sites[3].shape, f)]  # the third's result over the first's
    rows = [Row(site, i, i + 1) for i, site in enumerate(sites)]
    assert bands._in_place(rows[1:3], buffers) and not bands._in_place(rows[2:4], buffers)
    monkeypatch.setattr(bands, "MIN_GAIN_US", -1e9)  # cut, whatever the barrier it then needs costs
    monkeypatch.setattr(bands, "MIN_GAIN_SHARE", -1e9)
    team = bands.team_rows(rows, buffers, [4], 2)
    (call,) = band_calls(team)
    assert (call.src, call.dst) == (1, 3)

    def unused(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
        raise AssertionError("the chain fell back")
    chain = PrimitiveChain(rows, buffers, [(4, sites[3].shape)], 2 * inner, unused, "test", team)
    x = f32(*x_shape)
    want = x
    for site in sites:
        want = site(want)
    # one member running the bands in turn: a band that wrote over rows a later band still reads
    # shows every time, not only when the members' timing has it
    monkeypatch.setattr(omp, "TEAM", 1)
    np.testing.assert_allclose(bands_only(chain, x), want, rtol=TOL.rtol, atol=TOL.atol)
