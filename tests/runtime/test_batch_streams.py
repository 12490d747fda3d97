"""Batches split across the cores (runtime/batch_streams.py): a graph splits only where its
samples never meet, a split batch runs as pieces on separate threads each on a team of one, and
its results match TensorFlow's at the fp32 host tolerance of runtime/accuracy.py."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from kubetrt.runtime.accuracy import compare
from kubetrt.runtime.batch_streams import BatchStreams, StreamChoice, piece_size, streams_mode
from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.executor import SequentialPlan
from kubetrt.runtime.kernels import parallel
from kubetrt.runtime.onnx_import import from_proto, load_package_graph
from kubetrt.runtime.package import read_manifest
from onnx_cases import make_model
from test_model_families import FP32, feeds
from test_models import tf_outputs


class WatchedPlan(SequentialPlan):
    """A sequential plan that notes, per call, the thread, the batch and whether the thread runs alone."""

    calls: list[tuple[int, int, bool]]
    meet: threading.Barrier | None = None  # where set, each call waits for another thread's

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        self.calls.append((threading.get_ident(), feeds[0].shape[0], parallel.alone()))
        if self.meet is not None:
            self.meet.wait()
        return super().run(feeds)


def watched(model: onnx.ModelProto) -> WatchedPlan:
    plan = RUNTIME.prepare(from_proto(model), {})
    assert isinstance(plan, SequentialPlan)
    out = WatchedPlan(plan.prog)
    out.calls = []
    return out


def conv_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3, 12, 12)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "d"], ["y"]),
             helper.make_node("Softmax", ["y"], ["p"], axis=-1)]
    weights = {"w": rng.standard_normal((16, 3, 3, 3)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32),
               "d": rng.standard_normal((16, 5)).astype(np.float32)}
    return make_model(nodes, {"x": x}, ["p"], weights, dynamic_batch=True)


def test_a_split_batch_runs_as_pieces_on_two_threads_alone_with_the_whole_batchs_results() -> None:
    plan = watched(conv_model())
    streams = BatchStreams(plan, streams=2, mode="always", budget=1 << 40)
    x = np.random.default_rng(1).standard_normal((8, 3, 12, 12)).astype(np.float32)
    whole = plan.run([x])[0]
    first = streams.run([x])[0]  # decides the split: traced, not split yet
    plan.calls.clear()
    # the caller's piece waits for the other stream's: the caller cannot take the other share back
    # and run it itself, as it may where the shared pool is busy with other work
    plan.meet = threading.Barrier(2, timeout=60)
    split = streams.run([x])[0]
    np.testing.assert_allclose(first, whole, rtol=0, atol=0)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-6)
    assert {batch for _, batch, _ in plan.calls} == {4}  # each stream's share in one piece: the budget fits it
    assert len({thread for thread, _, _ in plan.calls}) == 2
    assert all(alone for _, _, alone in plan.calls)


def test_pieces_keep_a_stream_within_its_cache_budget() -> None:
    plan = watched(conv_model())
    x = np.random.default_rng(2).standard_normal((8, 3, 12, 12)).astype(np.float32)
    sample = 16 * 12 * 12 * 4  # bytes of the largest activation per sample: the convolution's output
    streams = BatchStreams(plan, streams=2, mode="always", budget=2 * sample)
    streams.run([x])
    plan.calls.clear()
    streams.run([x])
    assert sorted(batch for _, batch, _ in plan.calls) == [2, 2, 2, 2]
    assert piece_size(4, sample, 2 * sample) == 2 and piece_size(6, sample, 4 * sample) == 3 and piece_size(4, 10, 1) == 1


def mixing_models() -> dict[str, onnx.ModelProto]:
    x = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    cases = {
        "softmax over the batch": [helper.make_node("Softmax", ["x"], ["y"], axis=0)],
        "centred on the batch mean": [helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
                                      helper.make_node("Sub", ["x", "m"], ["y"])],
        "transposed": [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]), helper.make_node("Relu", ["t"], ["y"])],
        "concatenated along the batch": [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)],
        "samples paired": [helper.make_node("Reshape", ["x", "s"], ["y"])],
        "cumulative over the batch": [helper.make_node("CumSum", ["x", "a"], ["y"])],
        "tiled along the batch": [helper.make_node("Tile", ["x", "r"], ["y"])],
        "softmax across samples reshaped": [helper.make_node("Reshape", ["x", "across"], ["t"]),
                                            helper.make_node("Softmax", ["t"], ["u"], axis=-1),
                                            helper.make_node("Reshape", ["u", "back"], ["y"])],
    }
    inits = {"s": np.array([-1, 12], np.int64), "a": np.array(0, np.int64), "r": np.array([2, 1], np.int64),
             "across": np.array([6, -1], np.int64), "back": np.array([-1, 6], np.int64)}
    return {name: make_model(nodes, {"x": x}, ["y"], {k: v for k, v in inits.items() if any(k in n.input for n in nodes)},
                             dynamic_batch=True) for name, nodes in cases.items()}


@pytest.mark.parametrize("name", list(mixing_models()))
def test_a_graph_whose_samples_meet_keeps_its_batch_whole(name: str) -> None:
    plan = watched(mixing_models()[name])
    streams = BatchStreams(plan, streams=2, mode="always", budget=1)
    x = np.random.default_rng(4).standard_normal((8, 6)).astype(np.float32)
    whole = plan.run([x])[0]
    np.testing.assert_array_equal(streams.run([x])[0], whole)  # decides: traced at 8 and at a piece
    plan.calls.clear()
    np.testing.assert_array_equal(streams.run([x])[0], whole)
    assert [batch for _, batch, _ in plan.calls] == [8], "the batch was split"


def test_a_batch_that_does_not_divide_or_is_small_stays_whole() -> None:
    plan = watched(conv_model())
    streams = BatchStreams(plan, streams=2, mode="always")
    for n in (1, 2, 3, 5):
        x = np.zeros((n, 3, 12, 12), np.float32)
        streams.run([x])
        plan.calls.clear()
        streams.run([x])
        assert [batch for _, batch, _ in plan.calls] == [n]


def test_streams_setting_is_checked() -> None:
    assert streams_mode({}) == "auto" and streams_mode({"KUBETRT_BATCH_STREAMS": "OFF"}) == "off"
    with pytest.raises(ValueError, match="KUBETRT_BATCH_STREAMS='sometimes': expected one of auto, always, off"):
        streams_mode({"KUBETRT_BATCH_STREAMS": "sometimes"})


@pytest.mark.parametrize("name,splits", [("small_cnn", True), ("unet", True), ("resize", True), ("lstm", False)])
def test_zoo_models_split_and_match_tensorflow(zoo: Any, name: str, splits: bool) -> None:
    package, savedmodel = zoo.package(name), zoo.savedmodel(name)
    graph = load_package_graph(package, read_manifest(package))
    inputs, outputs = [v.name for v in graph.inputs], [v.name for v in graph.outputs]
    streams = BatchStreams(RUNTIME.prepare(graph, {}), streams=2, mode="always", budget=1)
    x = feeds(package, 6, 7)
    for _ in range(2):
        got = streams.run([x[n] for n in inputs])
    assert (list(streams._splits.values())[0] is not None) == splits
    result = compare(dict(zip(outputs, got)), tf_outputs(savedmodel, x), FP32)
    assert result.passed, f"{name} split in streams: {result.reason()}"


def test_stream_choice_tries_both_then_keeps_the_faster_through_one_slow_call() -> None:
    choice = StreamChoice()
    choice.ENABLED = True
    picks = []
    for seconds_whole, seconds_streams in [(10e-3, 8e-3)] * 8:
        streamed = choice.pick()
        picks.append(streamed)
        choice.record(streamed, seconds_streams if streamed else seconds_whole)
    assert picks[:StreamChoice.WARM] == [False] * StreamChoice.WARM  # the first calls are the whole batch's own
    assert picks[StreamChoice.WARM:StreamChoice.WARM + 4] == [False, True, False, True]  # turns
    assert picks[StreamChoice.WARM + 4:] == [True, True]
    choice.record(True, 0.1)  # one stalled streamed call
    assert choice.mean[1] is not None and choice.mean[1] <= 8e-3 * (1 + StreamChoice.ALPHA * StreamChoice.RISE) + 1e-9
    assert choice.pick()


def judged_over_time(choice: StreamChoice, seconds: dict[bool, float], calls: int) -> list[bool]:
    """`calls` picks of `choice`, each way taking its `seconds` -> the ways picked (True: streams)."""
    picks = []
    for _ in range(calls):
        streamed = choice.pick()
        picks.append(streamed)
        choice.record(streamed, seconds[streamed])
    return picks


def test_a_batch_judged_under_a_passing_load_takes_streams_back_once_they_are_faster() -> None:
    """The trials ran while another thread held a core (streams at twice the whole batch's time);
    then the load went and streams are faster: once the whole batch has run for EXPLORE_SECONDS,
    one call streams, wins, and the calls after it stream."""
    choice = StreamChoice()
    choice.ENABLED = True
    judged_over_time(choice, {False: 0.125, True: 0.25}, StreamChoice.WARM + 2 * StreamChoice.TRIALS)
    assert not choice.alone_faster()
    picks = judged_over_time(choice, {False: 0.125, True: 0.0625}, 15)
    explored = round(StreamChoice.EXPLORE_SECONDS / 0.125)  # whole calls before the first exploration
    assert picks[:explored] == [False] * explored
    assert picks[explored:] == [True] * (15 - explored)


def test_each_exploration_lost_doubles_the_wait_for_the_next_up_to_its_most() -> None:
    choice = StreamChoice()
    choice.ENABLED = True
    choice.EXPLORE = 10**9  # no exploration by the count of calls (TeamChoice's), only by their time
    picks = judged_over_time(choice, {False: 0.125, True: 0.25}, StreamChoice.WARM + 2 * StreamChoice.TRIALS + 700)
    explorations = [i for i, streamed in enumerate(picks) if streamed][StreamChoice.TRIALS:]
    whole_seconds = [0.125 * (b - a - 1) for a, b in zip(explorations, explorations[1:])]
    waits = [StreamChoice.EXPLORE_SECONDS * 2 ** k for k in range(1, 4)]
    assert whole_seconds[:3] == pytest.approx(waits)
    assert max(whole_seconds) == pytest.approx(StreamChoice.MAX_EXPLORE_SECONDS)
    assert whole_seconds[-1] == pytest.approx(StreamChoice.MAX_EXPLORE_SECONDS)


def after_the_trials(whole_s: float, streams_s: float) -> tuple[Any, BatchStreams, np.ndarray, Any]:
    """A conv plan's batch of 8 through its trials, each way timed as taking the seconds given ->
    (the watched plan, its BatchStreams, the batch, its Split as the first call made it)."""
    plan = watched(conv_model())
    streams = BatchStreams(plan, streams=2, mode="auto", budget=1 << 40)
    x = np.zeros((8, 3, 12, 12), np.float32)
    streams.run([x])
    split = streams._splits[(x.shape,)]
    assert split is not None
    split.choice.ENABLED = True
    split.choice.record = lambda streamed, seconds: StreamChoice.record(split.choice, streamed, streams_s if streamed else whole_s)  # type: ignore[method-assign]
    for _ in range(StreamChoice.WARM + 2 * StreamChoice.TRIALS):
        streams.run([x])
    return plan, streams, x, split


def test_streams_far_slower_after_the_trials_leave_the_signature_whole() -> None:
    plan, streams, x, _ = after_the_trials(1e-4, 1e-3)
    assert streams._splits[(x.shape,)] is None
    plan.calls.clear()
    streams.run([x])
    assert [batch for _, batch, _ in plan.calls] == [8]


def test_a_long_batch_whose_streams_lost_by_far_is_still_explored() -> None:
    plan, streams, x, split = after_the_trials(0.125, 1.0)
    assert streams._splits[(x.shape,)] is split
    plan.calls.clear()
    for _ in range(round(StreamChoice.EXPLORE_SECONDS / 0.125) + 1):
        streams.run([x])
    # whole batches of 8 until they have run EXPLORE_SECONDS, then one run explores streams: two pieces of 4
    assert [batch for _, batch, _ in plan.calls] == [8] * round(StreamChoice.EXPLORE_SECONDS / 0.125) + [4, 4]


def test_streaming_says_how_a_signature_runs_now() -> None:
    x = np.zeros((8, 3, 12, 12), np.float32)
    always = BatchStreams(watched(conv_model()), streams=2, mode="always", budget=1 << 40)
    assert always.streaming([x]) is None  # not called with yet
    always.run([x])
    split = always.streaming([x])
    assert split is not None and (split.batch, split.piece, split.streams) == (8, 4, 2)
    assert always.streaming([np.zeros((4, 3, 12, 12), np.float32)]) is None

    timed = BatchStreams(watched(conv_model()), streams=2, mode="auto", budget=1 << 40)
    timed.run([x])
    choice = timed._splits[(x.shape,)].choice  # type: ignore[union-attr]
    choice.mean = [1.0, 0.5]  # streams timed faster than the whole batch
    assert timed.streaming([x]) is not None
    choice.mean = [1.0, 0.99]  # within the margin: the batch runs whole
    assert timed.streaming([x]) is None
    choice.mean = [1.0, None]  # streams not timed yet
    assert timed.streaming([x]) is None
