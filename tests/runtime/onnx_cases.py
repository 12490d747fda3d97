"""Build single-op and small ONNX graphs in memory and run them with onnxruntime as the reference."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 17


def make_model(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], outputs: list[str], initializers: dict[str, np.ndarray] | None = None, dynamic_batch: bool = False) -> onnx.ModelProto:
    def vi(name: str, arr: np.ndarray) -> onnx.ValueInfoProto:
        shape: list[Any] = list(arr.shape)
        if dynamic_batch and shape:
            shape[0] = "N"
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape)

    graph = helper.make_graph(
        nodes,
        "case",
        [vi(k, v) for k, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(model)  # fills in the outputs' types
    return inferred


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_kubetrt(model: onnx.ModelProto, feeds: dict[str, np.ndarray], executor: str = "sequential") -> list[np.ndarray]:
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.onnx_import import from_proto

    graph = from_proto(model)
    exe = RUNTIME.prepare(graph, {"executor": executor})
    return exe.run([feeds[v.name] for v in graph.inputs])


def run_plan(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
             on_step: Callable[[str, tuple[Any, ...], tuple[np.ndarray, ...]], None] | None = None) -> tuple[list[np.ndarray], list[str]]:
    """The host plan's outputs and its kernels' ops in order: the plan compiled for these feeds'
    shapes where the model computes shapes. `on_step(op, args, outputs)` sees every kernel call."""
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.onnx_import import from_proto

    graph = from_proto(model)
    plan = RUNTIME.prepare(graph, {})
    args = [feeds[v.name] for v in graph.inputs]
    plan = plan.specialized(args) if hasattr(plan, "specialized") else plan
    if on_step is not None:
        ops = {k.id: k.op for k in plan.prog.kernels}

        def watched(run: Any, op: str) -> Any:
            def step(*step_args: Any) -> Any:
                out = run(*step_args)
                on_step(op, step_args, out)
                return out
            return step

        plan.steps = [(watched(r, ops[kid]), a, b, c, kid) for r, a, b, c, kid in plan.steps]
    return plan.run(args), [k.op for k in plan.prog.kernels]


def plan_ops_matching_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float) -> list[str]:
    """run_plan's ops, once its outputs have matched onnxruntime's within `tol` (rtol and atol)."""
    outputs, ops = run_plan(model, feeds)
    for got, want in zip(outputs, run_ort(model, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return ops


def node(op: str, inputs: list[str], outputs: list[str] | None = None, **attrs: Any) -> onnx.NodeProto:
    """A node named after its op and first output (unique per graph, readable in errors)."""
    outputs = outputs or ["y"]
    return helper.make_node(op, inputs, outputs, name=f"{op.lower()}_{outputs[0]}", **attrs)
