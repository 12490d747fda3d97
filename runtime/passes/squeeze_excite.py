"""Squeeze-and-excitation blocks become one node (kernels/squeeze_excite.py): in NHWC,

    GlobalAveragePool(x) -> 1x1 conv + act1 -> 1x1 conv + act2 -> Mul(x, gate)

where the pool, the convolutions and the gate are read by the next step alone, the weights are
float32 constants and the activations are ones the kernel computes. Runs after the layout pass
(the pattern is in its NHWC ops) and before the blocked one, which takes the node as a member.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Node, unique_name
from ..kernels.squeeze_excite import gate_form

OP = "SqueezeExciteNHWC"


def _dense(graph: Graph, node: Node | None, channels_in: int) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(W (out, in), bias) of a 1x1 float32 convolution of `channels_in` channels on one pixel
    whose activation the kernel computes; None for anything else."""
    if node is None or node.op != "FusedConvNHWC" or len(node.inputs) > 3 and node.inputs[3]:
        return None
    if node.attrs.get("group", 1) != 1 or any(s != 1 for s in node.attrs.get("strides") or ()) or any(node.attrs.get("pads") or ()):
        return None
    w = graph.constants.get(node.inputs[1])
    bias = graph.constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if w is None or w.dtype != np.float32 or w.ndim != 4 or w.shape[1:] != (channels_in, 1, 1) or gate_form(node.attrs.get("activation")) is None:
        return None
    if len(node.inputs) > 2 and node.inputs[2] and (bias is None or bias.shape != (w.shape[0],)):
        return None
    return np.ascontiguousarray(w[:, :, 0, 0]), bias


def fuse_squeeze_excite(graph: Graph) -> Graph:
    users, outputs = graph.consumers(), graph.output_names()

    def sole_reader(value: str) -> Node | None:
        readers = users.get(value, [])
        return readers[0] if len(readers) == 1 and value not in outputs else None

    taken = graph.value_names()
    for pool in list(graph.nodes):
        if pool.op != "GlobalAveragePoolNHWC":
            continue
        x = pool.inputs[0]
        info = graph.values.get(x)
        if info is None or info.dtype != np.float32 or info.shape is None or len(info.shape) != 4 or info.shape[3] <= 0:
            continue
        c = info.shape[3]
        squeeze = sole_reader(pool.outputs[0])
        first = _dense(graph, squeeze, c)
        excite = None if squeeze is None or first is None else sole_reader(squeeze.outputs[0])
        second = None if excite is None or first is None else _dense(graph, excite, first[0].shape[0])
        mul = None if excite is None or second is None or second[0].shape[0] != c else sole_reader(excite.outputs[0])
        if mul is None or mul.op != "Mul" or sorted(mul.inputs) != sorted([x, excite.outputs[0]]):  # type: ignore[union-attr]
            continue
        assert squeeze is not None and excite is not None and first is not None and second is not None
        names = [unique_name(f"{mul.name}/squeeze_excite_{k}", taken) for k in ("w1", "b1", "w2", "b2")]
        graph.constants[names[0]], graph.constants[names[2]] = first[0], second[0]
        for name, bias, width in ((names[1], first[1], first[0].shape[0]), (names[3], second[1], c)):
            graph.constants[name] = np.zeros(width, np.float32) if bias is None else np.ascontiguousarray(bias, np.float32)
        fused = Node(OP, unique_name(f"{mul.name}/squeeze_excite", taken), [x, *names], list(mul.outputs),
                     {"activations": [squeeze.attrs.get("activation"), excite.attrs.get("activation")]})
        graph.nodes[graph.nodes.index(mul)] = fused
        for gone in (pool, squeeze, excite):
            graph.nodes.remove(gone)
    return graph
