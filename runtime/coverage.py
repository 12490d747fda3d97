"""Which runtime runs each node of a graph, decided before anything is built or served.

A target device runs the nodes it has kernels for; the rest fall back, TF-TRT style, along one
chain: cuda -> host, host -> onnxruntime (an optional extra, only where a model was lowered
allowing it). TensorRT's own coverage is its ONNX parser's verdict, known only on a GPU node at
build time; its fallback segments then follow the cuda chain. A node with a sub-graph (If, Loop,
Scan) runs where every node of its sub-graphs can run too.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedOpError
from .graph import Graph, Node
from .kernels.registry import HOST, lookup
from .partition import partition

ONNXRUNTIME = "onnxruntime"
# Where a node goes when the device it was placed on has no kernel for it.
FALLBACK = {"tensorrt": "cuda", "cuda": HOST, HOST: ONNXRUNTIME}
KERNEL_DEVICES = (HOST, "cuda")  # devices whose kernels live in the kernel registry


def has_kernel(node: Node, device: str) -> bool:
    """`device` has a kernel for the node, and for every node of its sub-graphs (which run on the host)."""
    try:
        lookup(node.op, device)
    except UnsupportedOpError:
        return False
    return all(has_kernel(inner, HOST) for sub in node.subgraphs().values() for inner in sub.nodes)


def onnxruntime_installed() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


@dataclass
class Coverage:
    """Where each node of a graph runs when `device` is asked for."""

    device: str
    placement: dict[str, str]  # node name -> runtime that runs it
    ops: dict[str, str]  # node name -> op
    segments: list[dict[str, Any]] = field(default_factory=list)  # fallback segments: runtime, nodes, ops
    missing: list[str] = field(default_factory=list)  # nodes nothing allowed can run

    def ops_per_runtime(self) -> dict[str, dict[str, int]]:
        out: dict[str, Counter[str]] = {}
        for name, runtime in self.placement.items():
            out.setdefault(runtime, Counter())[self.ops[name]] += 1
        return {rt: dict(sorted(c.items())) for rt, c in out.items()}

    def fallback_runtimes(self) -> list[str]:
        return sorted({s["runtime"] for s in self.segments})

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "ops": self.ops_per_runtime(), "fallback_segments": self.segments,
                "missing": [{"node": n, "op": self.ops[n]} for n in self.missing]}


def describe(record: dict[str, Any]) -> list[str]:
    """A coverage record (`Coverage.to_json`, as manifests and build reports hold it) as lines."""
    lines = []
    for runtime, ops in record["ops"].items():
        total = sum(ops.values())
        lines.append(f"{runtime}: {total} node(s): " + ", ".join(f"{op} x{n}" for op, n in ops.items()))
    for seg in record["fallback_segments"]:
        lines.append(f"fallback segment {seg['index']} on {seg['runtime']}: {len(seg['nodes'])} node(s), ops "
                     + ", ".join(seg["ops"]))
    if not record["fallback_segments"]:
        lines.append(f"no fallback: every node runs on {record['device']}")
    return lines


def place(graph: Graph, device: str, allow: tuple[str, ...] = ()) -> Coverage:
    """Place every node on `device` or the first runtime down its fallback chain that can run it.

    `allow` names optional fallback runtimes (only `onnxruntime`) the caller accepts; a node no
    permitted runtime can run is listed in `missing`.
    """
    if device not in KERNEL_DEVICES:
        raise ValueError(f"coverage of device {device!r}: expected one of {', '.join(KERNEL_DEVICES)} "
                         "(TensorRT's coverage is its parser's, decided at build on the GPU node)")
    placement: dict[str, str] = {}
    missing: list[str] = []
    for node in graph.nodes:
        runtime: str | None = device
        while runtime is not None and not _runs(node, runtime):
            runtime = FALLBACK.get(runtime)
            if runtime == ONNXRUNTIME and ONNXRUNTIME not in allow:
                runtime = None
        if runtime is None:
            missing.append(node.name)
            runtime = "none"
        placement[node.name] = runtime
    cov = Coverage(device, placement, {n.name: n.op for n in graph.nodes}, missing=missing)
    cov.segments = _segments(graph, placement, device)
    return cov


def place_segments(graph: Graph, device: str, backend_nodes: set[str], allow: tuple[str, ...] = ()) -> Coverage:
    """Coverage of a backend whose own support is a set of nodes (TensorRT's parser verdict, known
    at build): those run on `device`, the rest where its fallback would place them."""
    rest = place(graph, FALLBACK[device], allow)
    placement = {n.name: device if n.name in backend_nodes else rest.placement[n.name] for n in graph.nodes}
    cov = Coverage(device, placement, rest.ops, missing=[n for n in rest.missing if n not in backend_nodes])
    cov.segments = _segments(graph, placement, device)
    return cov


def _runs(node: Node, runtime: str) -> bool:
    if runtime == ONNXRUNTIME:
        return node.domain in ("", "ai.onnx")  # onnxruntime implements the whole standard opset
    return has_kernel(node, runtime)


def _segments(graph: Graph, placement: dict[str, str], device: str) -> list[dict[str, Any]]:
    if all(rt == device for rt in placement.values()):
        return []
    out = []
    for seg in partition(graph, lambda n: placement[n.name] == device):
        if seg.supported:
            continue
        runtimes = sorted({placement[n.name] for n in seg.nodes})
        out.append({"index": seg.index, "runtime": "+".join(runtimes), "nodes": seg.node_names,
                    "ops": sorted({n.op for n in seg.nodes}), "inputs": seg.inputs, "outputs": seg.outputs})
    return out


def require_runnable(graph: Graph, device: str, model: str, allow: tuple[str, ...] = (),
                     hint: str | None = None) -> Coverage:
    """The coverage, or UnsupportedOpError naming each node nothing can run, its op and the model."""
    cov = place(graph, device, allow)
    if cov.missing:
        shown = ", ".join(f"{n} ({cov.ops[n]})" for n in cov.missing[:8])
        more = f" and {len(cov.missing) - 8} more" if len(cov.missing) > 8 else ""
        if hint is None and ONNXRUNTIME not in allow:
            hint = ("onnxruntime could run them: lower with --allow-fallback onnxruntime (serving then "
                    "needs the kubetrt[fallback] extra)")
        raise UnsupportedOpError(f"model {model}: no kernel on {device} or its fallbacks for {len(cov.missing)} "
                                 f"node(s): {shown}{more}" + (f"; {hint}" if hint else ""))
    return cov
