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


Dense = tuple[np.ndarray, np.ndarray | None]


def _block(graph: Graph, pool: Node, users: dict[str, list[Node]], outputs: set[str]) -> tuple[list[Node], Dense, Dense] | None:
    """The block that starts at a global pool: its nodes (pool, the two convolutions, the Mul)
    and the convolutions' weights; None where the pattern does not hold."""
    def sole_reader(node: Node) -> Node | None:
        readers = users.get(node.outputs[0], [])
        return readers[0] if len(readers) == 1 and node.outputs[0] not in outputs else None

    info = graph.values.get(pool.inputs[0])
    if info is None or info.dtype != np.float32 or info.shape is None or len(info.shape) != 4 or info.shape[3] <= 0:
        return None
    c = info.shape[3]
    squeeze = sole_reader(pool)
    first = _dense(graph, squeeze, c)
    if squeeze is None or first is None:
        return None
    excite = sole_reader(squeeze)
    second = _dense(graph, excite, first[0].shape[0])
    if excite is None or second is None or second[0].shape[0] != c:
        return None
    mul = sole_reader(excite)
    if mul is None or mul.op != "Mul" or sorted(mul.inputs) != sorted([pool.inputs[0], excite.outputs[0]]):
        return None
    return [pool, squeeze, excite, mul], first, second


def fuse_squeeze_excite(graph: Graph) -> Graph:
    users, outputs = graph.consumers(), graph.output_names()
    taken = graph.value_names()
    for pool in [n for n in graph.nodes if n.op == "GlobalAveragePoolNHWC"]:
        found = _block(graph, pool, users, outputs)
        if found is None:
            continue
        (_, squeeze, excite, mul), first, second = found
        names = [unique_name(f"{mul.name}/squeeze_excite_{k}", taken) for k in ("w1", "b1", "w2", "b2")]
        for (w_name, b_name), (w, bias) in zip((names[:2], names[2:]), (first, second)):
            graph.constants[w_name] = w
            graph.constants[b_name] = np.zeros(w.shape[0], np.float32) if bias is None else np.ascontiguousarray(bias, np.float32)
        fused = Node(OP, unique_name(f"{mul.name}/squeeze_excite", taken), [pool.inputs[0], *names], list(mul.outputs),
                     {"activations": [squeeze.attrs.get("activation"), excite.attrs.get("activation")]})
        graph.nodes[graph.nodes.index(mul)] = fused
        for gone in (pool, squeeze, excite):
            graph.nodes.remove(gone)
    return graph
