"""Shared helpers for tests/gpu: package loading and onnxruntime-backed segment executables."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from kubetrt.runtime.graph import Graph
from kubetrt.runtime.onnx_import import load_package_graph
from kubetrt.runtime.package import load_golden, open_package


def load(pkg: Path) -> tuple[Graph, dict[int, Any]]:
    manifest = open_package(pkg)
    return load_package_graph(pkg, manifest), load_golden(pkg, manifest)


def max_error(got: list[np.ndarray], want: dict[str, np.ndarray], graph: Graph) -> float:
    """Largest absolute difference over all outputs (they are probabilities/logits of size ~1)."""
    assert len(got) == len(graph.outputs)
    errs = []
    for g, o in zip(got, graph.outputs):
        assert g.shape == want[o.name].shape, (o.name, g.shape, want[o.name].shape)
        errs.append(float(np.max(np.abs(g.astype(np.float64) - want[o.name].astype(np.float64)))))
    return max(errs)


def check_all_batches(run: Any, graph: Graph, golden: dict[int, Any], tol: float) -> None:
    assert golden, "the package has no golden data"
    for batch, (ins, outs) in golden.items():
        err = max_error(run([ins[v.name] for v in graph.inputs]), outs, graph)
        assert err <= tol, f"batch {batch}: max error {err:.3g} > {tol}"


class OrtExecutable:
    """onnxruntime (CPU) standing where a TensorRT engine would run an exported segment."""

    def __init__(self, model: onnx.ModelProto) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, dict(zip(self.names, feeds)))


def fresh(graph: Graph) -> Graph:
    return copy.deepcopy(graph)
