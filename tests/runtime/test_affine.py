"""passes/affine.py: chains of Mul/Add/Sub/Div by per-channel constants run as one MulAdd pass,
checked against onnxruntime on the model as written. The nets are laid out as converters hand
over a Keras model: an NHWC input scaled per channel, then a Transpose to the convolutions' NCHW."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.kernels.registry import KernelSpec, lookup
from onnx_cases import make_model, node, run_ort, run_plan

rng = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def check(nodes: list, consts: dict[str, np.ndarray], outputs: list[str]) -> list[str]:
    """The plan's ops, after its outputs matched onnxruntime's at batch 1 and 3."""
    model = make_model(nodes, {"x": f32(1, 6, 6, 3)}, outputs, consts, dynamic_batch=True)
    for batch in (1, 3):
        feeds = {"x": f32(batch, 6, 6, 3) * 50 + 100}
        got, ops = run_plan(model, feeds)
        for g, want in zip(got, run_ort(model, feeds)):
            # float32 sums of pixel-sized products: the bound scales with the outputs' size
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())))
    return ops


def stem(first: str) -> list:
    return [node("Transpose", [first], ["t"], perm=[0, 3, 1, 2]), node("Conv", ["t", "w"], ["c1"], pads=[1, 1, 1, 1]),
            node("Relu", ["c1"], ["r"]), node("Conv", ["r", "w2"], ["y"])]


W = {"w": f32(8, 3, 3, 3), "w2": f32(4, 8, 1, 1)}


def test_input_scaling_runs_as_one_pass() -> None:
    # EfficientNet's: Rescaling (x / 255), Normalization (minus the mean, over the deviation), Rescaling
    consts = {"s": np.array(1 / 255, np.float32), "mean": f32(3), "std": np.abs(f32(3)) + 0.5, "rescale": f32(3), **W}
    nodes = [node("Mul", ["x", "s"], ["a"]), node("Sub", ["a", "mean"], ["b"]), node("Div", ["b", "std"], ["c"]),
             node("Mul", ["c", "rescale"], ["d"])] + stem("d")
    ops = check(nodes, consts, ["y"])
    assert ops.count("MulAdd") == 1 and not {"Mul", "Sub", "Div"} & set(ops), ops


def test_constants_on_either_side_compose() -> None:
    # 2 - (0.5 + x * k): the constant first in Sub and Add
    consts = {"k": f32(3), "h": np.array(0.5, np.float32), "two": np.array(2, np.float32), **W}
    nodes = [node("Mul", ["k", "x"], ["a"]), node("Add", ["h", "a"], ["b"]), node("Sub", ["two", "b"], ["c"])] + stem("c")
    ops = check(nodes, consts, ["y"])
    assert ops.count("MulAdd") == 1 and not {"Mul", "Sub", "Add"} & set(ops), ops


def test_a_value_read_elsewhere_ends_the_chain_and_a_reciprocal_is_no_link() -> None:
    consts = {"k": f32(3), "m": f32(3), "one": np.array(1, np.float32), **W}
    nodes = [node("Mul", ["x", "k"], ["a"]), node("Add", ["a", "m"], ["b"]), node("Div", ["one", "b"], ["c"]),
             node("Mul", ["c", "k"], ["d"])] + stem("d")
    ops = check(nodes, consts, ["y", "b"])  # b is also an output: the chain ends there
    assert ops.count("MulAdd") == 1 and ops.count("Div") == 1 and ops.count("Mul") == 1, ops


def test_a_single_step_stays_as_it_is() -> None:
    consts = {"k": f32(3), **W}
    ops = check([node("Mul", ["x", "k"], ["a"])] + stem("a"), consts, ["y"])
    assert "MulAdd" not in ops and ops.count("Mul") == 1, ops


def test_an_input_of_another_width_is_named() -> None:
    scale, shift = np.ones(3, np.float32), np.zeros(3, np.float32)
    spec = KernelSpec("MulAdd", "scaling", {}, [None, scale, shift], [(1, 4, 4, 3), (3,), (3,)], [np.dtype(np.float32)] * 3)
    run = lookup("MulAdd").factory(spec)
    np.testing.assert_allclose(run(np.full((1, 4, 4, 3), 2, np.float32), scale, shift)[0], 2)
    with pytest.raises(ValueError, match=r"MulAdd scaling: expected float32 input with 3 values on its last axis, got float32\[1, 4, 4, 5\]"):
        run(np.ones((1, 4, 4, 5), np.float32), scale, shift)


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_a_division_by_zero_is_no_link() -> None:
    consts = {"k": f32(3), "m": f32(3), "z": np.array([1, 0, 2], np.float32), **W}
    nodes = [node("Mul", ["x", "k"], ["a"]), node("Div", ["a", "z"], ["b"]), node("Add", ["b", "m"], ["c"])] + stem("c")
    model = make_model(nodes, {"x": f32(1, 6, 6, 3)}, ["c", "y"], consts, dynamic_batch=True)
    feeds = {"x": f32(2, 6, 6, 3)}
    got, ops = run_plan(model, feeds)
    np.testing.assert_allclose(got[0], run_ort(model, feeds)[0], rtol=1e-6)  # a channel of infinities, as onnxruntime has it
    assert "MulAdd" not in ops and ops.count("Div") == 1, ops


def dense_block(layers: int) -> tuple[list, dict[str, np.ndarray]]:
    """DenseNet's layout as converters write it (NCHW after the input's Transpose): each layer
    reads the running concatenation through batch norm (Mul, Add per channel) and ReLU into a
    convolution, whose result joins the concatenation, which the next layer and the next
    concatenation both read."""
    nodes = [node("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]), node("Conv", ["t", "w"], ["cat0"], pads=[1, 1, 1, 1])]
    consts: dict[str, np.ndarray] = {"w": f32(8, 3, 3, 3)}
    width = 8
    for i in range(layers):
        consts.update({f"s{i}": f32(width, 1, 1), f"b{i}": f32(width, 1, 1), f"k{i}": f32(4, width, 1, 1)})
        nodes += [node("Mul", [f"cat{i}", f"s{i}"], [f"m{i}"]), node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  node("Relu", [f"a{i}"], [f"r{i}"]), node("Conv", [f"r{i}", f"k{i}"], [f"c{i}"]),
                  node("Concat", [f"cat{i}", f"c{i}"], [f"cat{i + 1}"], axis=1)]
        width += 4
    return nodes + [node("Conv", [f"cat{layers}", "last"], ["y"])], {**consts, "last": f32(4, width, 1, 1)}


def test_batch_norm_and_relu_before_a_convolution_run_as_one_pass_with_no_transposes() -> None:
    nodes, consts = dense_block(3)
    ops = check(nodes, consts, ["y"])
    assert ops.count("MulAdd") == 3 and not {"Mul", "Add", "Relu"} & set(ops), ops
    assert ops.count("Transpose") == 1 and ops[-1] == "Transpose", ops  # only the one to the model's NCHW output


def test_a_relu_read_by_two_nodes_is_no_link_of_the_pass() -> None:
    consts = {"k": f32(3), "m": f32(3), **W}
    nodes = [node("Mul", ["x", "k"], ["a"]), node("Add", ["a", "m"], ["b"]), node("Relu", ["b"], ["c"])] + stem("c")
    ops = check(nodes, consts, ["y", "c"])  # the ReLU's result is an output too: fused, it is still the MulAdd's
    assert ops.count("MulAdd") == 1 and "Relu" not in ops, ops
    nodes = [node("Mul", ["x", "k"], ["a"]), node("Add", ["a", "m"], ["b"])] + stem("b")
    ops = check(nodes, consts, ["y", "b"])  # the chain's own result read twice: no ReLU to take
    assert ops.count("MulAdd") == 1, ops
