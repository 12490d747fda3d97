"""The host device runtime: NumPy kernels, sequential plan or dataflow executor."""
from __future__ import annotations

import copy
import platform
from typing import Any

import numpy as np

from ..executor import DataflowExecutor, SequentialPlan
from ..graph import Graph
from ..kernels import parallel
from ..memory import keep_freed_memory
from ..timing import median_seconds
from ..program import compile_graph
from ..target import Target
from ..partition import SegmentRunner
from ..specialize import SHAPE_OPS, ShapeSpecializedPlan, computes_shapes
from . import NodeIdentity
from .onnxruntime_fallback import host_coverage, prepare_with_fallback

class HostRuntime:
    name = "host"

    def check_available(self) -> None:
        return None

    def identity(self) -> NodeIdentity:
        return NodeIdentity("cpu", None, f"numpy{np.__version__}-{platform.machine()}")

    def prepare(self, graph: Graph, options: dict[str, Any]) -> SequentialPlan | ShapeSpecializedPlan | DataflowExecutor | SegmentRunner:
        """A plan for `graph`; nodes without a host kernel run in onnxruntime segments between
        host segments, where the model allows it (see runtime/coverage.py)."""
        coverage = host_coverage(graph)
        if coverage.segments:
            return prepare_with_fallback(graph, coverage, lambda segment: self.prepare(segment, options))
        parallel.single_threaded_blas()
        keep_freed_memory()
        executor = options.get("executor", "sequential")
        if executor == "dataflow":
            return DataflowExecutor(compile_graph(graph, "host", concurrent=True, subgraph_plan=SequentialPlan),
                                    parallel.shared_pool())
        if executor != "sequential":
            raise ValueError(f"host executor {executor!r}: expected sequential or dataflow")
        # only a graph with dynamic inputs and shape ops can need specializing: others skip the copy
        dynamic = any(d < 0 for v in graph.inputs for d in v.shape or ())
        pristine = copy.deepcopy(graph) if dynamic and any(n.op in SHAPE_OPS for n in graph.nodes) else None
        plan = _sequential(graph)
        if pristine is not None and computes_shapes(plan.prog):
            return ShapeSpecializedPlan(pristine, plan, _sequential)
        return plan

    def tune(self, graph: Graph, target: Target, golden: dict[int, Any]) -> dict[str, Any]:
        """Pick the faster executor for this model on this node, timed on the golden inputs."""
        batch = max(golden) if golden else None
        if batch is None:
            return {"executor": "sequential"}
        feeds = [golden[batch][0][i.name] for i in graph.inputs]
        timings = {}
        for executor in ("sequential", "dataflow"):
            exe = self.prepare(copy.deepcopy(graph), {"executor": executor})
            timings[executor] = median_seconds(lambda: exe.run(feeds), repeats=3)
        best = min(timings, key=timings.__getitem__)
        return {"executor": best, "timings_s": timings, "tuned_batch": batch}


def _sequential(graph: Graph) -> SequentialPlan:
    return SequentialPlan(compile_graph(graph, "host", subgraph_plan=SequentialPlan))


RUNTIME = HostRuntime()
