"""onnxruntime as the last fallback: segments of a graph the host has no kernel for.

Never required: only a model lowered with `--allow-fallback onnxruntime` needs it, and then the
serving image installs the `fallback` extra. Without it such a model is refused when it is
loaded, naming the nodes, never at its first request.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..coverage import ONNXRUNTIME, Coverage, onnxruntime_installed, require_runnable
from ..graph import Graph
from ..partition import Executable, SegmentRunner, export_segment, partition, segment_graph


class OnnxruntimeSegment:
    """One exported segment in an onnxruntime session (CPU provider)."""

    def __init__(self, model_bytes: bytes, inputs: list[str]) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        self.inputs = inputs

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        return list(self.session.run(None, dict(zip(self.inputs, feeds))))


def host_coverage(graph: Graph, model: str = "model") -> Coverage:
    """Where the host runtime runs each node; refused (naming the nodes) if onnxruntime would be
    needed and is not installed."""
    if onnxruntime_installed():
        return require_runnable(graph, "host", model, allow=(ONNXRUNTIME,))
    return require_runnable(graph, "host", model, hint="onnxruntime could run them: install the kubetrt[fallback] extra")


def prepare_with_fallback(graph: Graph, coverage: Coverage, prepare: Callable[[Graph], Executable]) -> SegmentRunner:
    """Host segments prepared by `prepare`, the others in onnxruntime, chained in order."""
    segments = partition(graph, lambda n: coverage.placement[n.name] == "host")
    exes: list[Any] = []
    for seg in segments:
        if seg.supported:
            exes.append(prepare(segment_graph(graph, seg)))
        else:
            exes.append(OnnxruntimeSegment(export_segment(graph, seg).SerializeToString(), seg.inputs))
    return SegmentRunner(graph, segments, exes)
