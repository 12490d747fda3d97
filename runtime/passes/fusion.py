"""Fusion: fold per-channel affine ops into convolution weights, then fuse bias, residual and
activation epilogues into FusedConv / FusedMatMul (and the integer QConv / QMatMul) so each
tensor is written once, not four times.

A producer is fused only when its output has exactly one consumer and is not a graph output, so
no intermediate that someone else reads ever disappears.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import Graph, Node, ValueInfo, unique_name
from ..kernels.activations import FUSABLE
from ..kernels.registry import SOFTMAX_SCALE


class ConsumerIndex:
    """Producer/consumer maps kept in sync while nodes are rewritten."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.users = graph.consumers()
        self.outputs = graph.output_names()

    def sole_user(self, value: str) -> Node | None:
        users = self.users.get(value, [])
        if len(users) != 1 or value in self.outputs:
            return None
        return users[0]

    def bypass(self, consumer: Node, producer: Node) -> None:
        """`consumer` is absorbed into `producer`: producer now writes consumer's output."""
        producer.outputs = [consumer.outputs[0]]
        self.graph.nodes.remove(consumer)
        self.users = self.graph.consumers()


def _const(graph: Graph, name: str) -> np.ndarray | None:
    return graph.constants.get(name) if name else None


def _per_channel(c: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """A constant that broadcasts over NCHW as one value per channel -> shape (channels,)."""
    if c.ndim > rank:
        return None
    shape = (1,) * (rank - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float32)


def _add_const(graph: Graph, value: np.ndarray, hint: str) -> str:
    name = hint
    k = 0
    while name in graph.constants or name in graph.values:
        k += 1
        name = f"{hint}.{k}"
    graph.constants[name] = value
    return name


def _conv_channels(graph: Graph, conv: Node) -> int | None:
    w = _const(graph, conv.inputs[1])
    return None if w is None else int(w.shape[0])


def _ensure_bias(graph: Graph, conv: Node, channels: int, dtype: np.dtype) -> np.ndarray:
    if len(conv.inputs) > 2 and conv.inputs[2] and conv.inputs[2] in graph.constants:
        return graph.constants[conv.inputs[2]].astype(dtype)
    return np.zeros(channels, dtype=dtype)


def fold_affine_into_conv(graph: Graph) -> bool:
    """Conv -> BatchNormalization, or Conv -> Mul(c) / Add(c) with per-channel constants."""
    idx = ConsumerIndex(graph)
    for conv in list(graph.nodes):
        if conv.op not in ("Conv", "FusedConv") or conv.attrs.get("activation") or len(conv.inputs) > 3:
            continue
        w = _const(graph, conv.inputs[1])
        if w is None or w.ndim != 4:
            continue
        user = idx.sole_user(conv.outputs[0])
        if user is None:
            continue
        channels = w.shape[0]
        bias = _ensure_bias(graph, conv, channels, w.dtype)
        if user.op == "BatchNormalization" and len(user.outputs) == 1 and all(i in graph.constants for i in user.inputs[1:]):
            scale, b, mean, var = (graph.constants[i].astype(np.float64) for i in user.inputs[1:5])
            s = scale / np.sqrt(var + user.attrs.get("epsilon", 1e-5))
            new_w = (w * s.reshape(-1, 1, 1, 1)).astype(w.dtype)
            new_b = ((bias - mean) * s + b).astype(w.dtype)
        elif user.op in ("Mul", "Add") and len(user.inputs) == 2:
            other = user.inputs[1] if user.inputs[0] == conv.outputs[0] else user.inputs[0]
            c = _const(graph, other)
            pc = None if c is None else _per_channel(c, channels, 4)
            if pc is None:
                continue
            if user.op == "Mul":
                new_w, new_b = (w * pc.reshape(-1, 1, 1, 1)).astype(w.dtype), (bias * pc).astype(w.dtype)
            else:
                new_w, new_b = w, (bias + pc).astype(w.dtype)
        else:
            continue
        conv.inputs = [conv.inputs[0], _add_const(graph, new_w, conv.inputs[1] + ".folded"), _add_const(graph, new_b, conv.name + ".bias")]
        idx.bypass(user, conv)
        return True
    return False


def _zero_spatial_pads(graph: Graph, pad: Node) -> list[int] | None:
    """[top, left, bottom, right] of a Pad that adds zeros on an NCHW tensor's spatial dims only."""
    if pad.op != "Pad" or pad.attrs.get("mode", "constant") != "constant":
        return None
    pads = _const(graph, pad.inputs[1]) if len(pad.inputs) > 1 else np.asarray(pad.attrs.get("pads"))
    value = _const(graph, pad.inputs[2]) if len(pad.inputs) > 2 and pad.inputs[2] else np.zeros(())
    if pads is None or value is None or np.any(value != 0) or (len(pad.inputs) > 3 and pad.inputs[3]):
        return None
    p = [int(v) for v in pads.reshape(-1)]
    if len(p) != 8 or any(v < 0 for v in p) or p[0] or p[1] or p[4] or p[5]:
        return None
    return [p[2], p[3], p[6], p[7]]


def explicit_pads(node: Node) -> list[int]:
    """A convolution's or pool's [top, left, bottom, right] padding where auto_pad is NOTSET or VALID."""
    return [0, 0, 0, 0] if node.attrs.get("auto_pad") == "VALID" else list(node.attrs.get("pads") or [0, 0, 0, 0])


def fold_pad_into_conv(graph: Graph) -> bool:
    """Explicit zero Pad on the spatial dims before a Conv becomes the Conv's own padding."""
    idx = ConsumerIndex(graph)
    for pad in list(graph.nodes):
        p = _zero_spatial_pads(graph, pad)
        conv = None if p is None else idx.sole_user(pad.outputs[0])
        if p is None or conv is None or conv.op not in ("Conv", "FusedConv") or conv.inputs[0] != pad.outputs[0]:
            continue
        if conv.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            continue
        conv.attrs = {**conv.attrs, "auto_pad": "NOTSET", "pads": [a + b for a, b in zip(explicit_pads(conv), p)]}
        conv.inputs = [pad.inputs[0]] + conv.inputs[1:]
        graph.nodes.remove(pad)
        return True
    return False


def _non_negative(graph: Graph, value: str) -> bool:
    """Whether `value` is a fused ReLU's (or ReLU6's) output."""
    producer = graph.producers().get(value)
    act = None if producer is None else producer.attrs.get("activation")
    return act is not None and (act[0] == "Relu" or (act[0] == "Clip" and act[1].get("min", -1.0) >= 0.0))


def fold_pad_into_max_pool(graph: Graph) -> bool:
    """Zero Pad before a MaxPool, on a ReLU's output, becomes the pool's own padding: a max pool's
    padding never wins, and neither does a zero beside values that are all at least zero (ResNet's
    stem). One pass over the stem's output fewer, and the pool reads the convolution's layout."""
    idx = ConsumerIndex(graph)
    for pad in list(graph.nodes):
        p = _zero_spatial_pads(graph, pad)
        pool = None if p is None else idx.sole_user(pad.outputs[0])
        if p is None or pool is None or pool.op != "MaxPool" or len(pool.outputs) != 1 or pool.attrs.get("ceil_mode", 0) \
                or pool.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or any(d != 1 for d in pool.attrs.get("dilations") or ()) \
                or not _non_negative(graph, pad.inputs[0]):
            continue
        pads = [a + b for a, b in zip(explicit_pads(pool), p)]
        kernel = list(pool.attrs.get("kernel_shape") or ())
        if len(kernel) != 2 or any(v >= kernel[i % 2] for i, v in enumerate(pads)):  # a window of padding alone would give 0, not -inf
            continue
        pool.attrs = {**pool.attrs, "auto_pad": "NOTSET", "pads": pads}
        pool.inputs = [pad.inputs[0]]
        graph.nodes.remove(pad)
        return True
    return False


def _activation_attrs(graph: Graph, node: Node) -> tuple[str, dict[str, Any]] | None:
    """The `activation` attr for a fused epilogue, for the activations the table marks fusable."""
    if node.op not in FUSABLE:
        return None
    if node.op == "Clip":
        bounds = {}
        for i, key in ((1, "min"), (2, "max")):
            if len(node.inputs) > i and node.inputs[i]:
                c = _const(graph, node.inputs[i])
                if c is None:
                    return None
                bounds[key] = float(c)
            elif key in node.attrs:
                bounds[key] = float(node.attrs[key])
        return ("Clip", bounds)
    return (node.op, dict(node.attrs))


def fuse_epilogues(graph: Graph) -> bool:
    """Conv/MatMul + bias Add + residual Add + activation -> one fused node."""
    idx = ConsumerIndex(graph)
    for node in list(graph.nodes):
        if node.op == "Conv":
            node.op = "FusedConv"
            node.inputs = node.inputs + [""] * (3 - len(node.inputs))
        if node.op == "MatMul" and (w := _const(graph, node.inputs[1])) is not None and w.ndim == 2:
            node.op = "FusedMatMul"
            node.inputs = node.inputs + [""]
        if node.op == "QMatMul" and len(node.inputs) == 2:
            node.inputs = node.inputs + [""]
        if node.op not in ("FusedConv", "FusedMatMul", "QConv", "QMatMul") or node.attrs.get("activation"):
            continue
        user = idx.sole_user(node.outputs[0])
        if user is None:
            continue
        act = _activation_attrs(graph, user)
        if act is not None:
            node.attrs = {**node.attrs, "activation": act}
            idx.bypass(user, node)
            return True
        if user.op != "Add" or len(user.inputs) != 2 or len(node.inputs) > 3:
            continue
        other = user.inputs[1] if user.inputs[0] == node.outputs[0] else user.inputs[0]
        c = _const(graph, other)
        if c is not None:  # bias
            if node.op in ("FusedMatMul", "QMatMul") and c.ndim == 1 and not node.inputs[2]:
                node.inputs[2] = other
                idx.bypass(user, node)
                return True
            continue
        mine, theirs = graph.values.get(node.outputs[0]), graph.values.get(other)
        if mine is None or theirs is None or mine.shape is None or mine.shape != theirs.shape:
            continue
        if not all(d > 0 for d in mine.shape[1:]):
            continue
        node.inputs = node.inputs + [other]  # residual
        idx.bypass(user, node)
        return True
    return False


def fuse_residual_through_reshape(graph: Graph) -> bool:
    """FusedMatMul -> Reshape -> Add(residual): the matmul sums the residual, reshaped to its own
    rows, and the Reshape moves after it (a transformer's feed-forward output, computed on
    (batch*seq, d) rows and added back to (batch, seq, d) activations). A reshape keeps the element
    order, so the sum is the same; the Add and its pass over the tensor are gone."""
    idx = ConsumerIndex(graph)
    for mm in graph.nodes:
        if mm.op != "FusedMatMul" or len(mm.inputs) != 3 or mm.attrs.get("activation"):
            continue
        reshape = idx.sole_user(mm.outputs[0])
        if reshape is None or reshape.op != "Reshape":
            continue
        add = idx.sole_user(reshape.outputs[0])
        if add is None or add.op != "Add" or len(add.inputs) != 2:
            continue
        other = add.inputs[1] if add.inputs[0] == reshape.outputs[0] else add.inputs[0]
        rows, theirs = graph.values.get(mm.outputs[0]), graph.values.get(other)
        reshaped = graph.values.get(reshape.outputs[0])
        if rows is None or theirs is None or reshaped is None or rows.shape is None or theirs.shape is None \
                or theirs.shape != reshaped.shape or sum(d == -1 for d in rows.shape) > 1 or any(d == 0 for d in rows.shape) \
                or any(d < -1 for d in rows.shape) or theirs.dtype != rows.dtype:
            continue
        taken = graph.value_names()
        as_rows = unique_name(f"{other}:as_rows", taken)
        shape = _add_const(graph, np.array(rows.shape, np.int64), f"{as_rows}_shape")
        graph.nodes.insert(graph.nodes.index(mm), Node("Reshape", unique_name(f"{mm.name}/residual_rows", taken), [other, shape], [as_rows]))
        graph.values[as_rows] = ValueInfo(as_rows, rows.dtype, rows.shape)
        mm.inputs = mm.inputs + [as_rows]
        reshape.outputs = [add.outputs[0]]
        graph.nodes.remove(add)
        return True
    return False


def fold_scale_into_softmax(graph: Graph) -> Graph:
    """Mul (or Div) by a scalar constant whose only reader is a (Log)Softmax: the softmax scales
    as it reads (attention's 1/sqrt(d) on its scores), one pass over the tensor fewer. A host
    kernel attribute (SOFTMAX_SCALE), so only the host pipeline runs this."""
    idx = ConsumerIndex(graph)
    for node in list(graph.nodes):
        if node.op not in ("Mul", "Div") or len(node.inputs) != 2:
            continue
        user = idx.sole_user(node.outputs[0])
        if user is None or user.op not in ("Softmax", "LogSoftmax") or SOFTMAX_SCALE in user.attrs:
            continue
        c = _const(graph, node.inputs[1])
        x = graph.values.get(node.inputs[0])
        if c is None and node.op == "Mul":
            c, x = _const(graph, node.inputs[0]), graph.values.get(node.inputs[1])
            src = node.inputs[1]
        else:
            src = node.inputs[0]
        if c is None or c.size != 1 or x is None or x.shape is None or c.ndim > len(x.shape) \
                or x.dtype != np.float32 or c.dtype != np.float32 or src in graph.constants:
            continue
        value = float(c.reshape(-1)[0])
        if node.op == "Div" and value == 0.0:
            continue
        user.attrs = {**user.attrs, SOFTMAX_SCALE: 1.0 / value if node.op == "Div" else value}
        user.inputs = [src]
        graph.nodes.remove(node)
        idx.users = graph.consumers()
    return graph


def sink_reshape_below_activation(graph: Graph) -> bool:
    """MatMul -> Reshape -> activation becomes MatMul -> activation -> Reshape, which the epilogue
    fusion then takes: converters wrap a dense layer on a 3-D tensor (Keras Tensordot) as
    Reshape, 2-D MatMul, Reshape, so its activation never sits right after the product. An
    elementwise function commutes with any reshape."""
    idx = ConsumerIndex(graph)
    producers = graph.producers()
    for reshape in graph.nodes:
        if reshape.op != "Reshape":
            continue
        source = producers.get(reshape.inputs[0])
        act = idx.sole_user(reshape.outputs[0])
        if source is None or source.op not in ("MatMul", "FusedMatMul") or source.attrs.get("activation") \
                or act is None or act.inputs[0] != reshape.outputs[0] or _activation_attrs(graph, act) is None \
                or any(i and i not in graph.constants for i in act.inputs[1:]):
            continue
        before = graph.values.get(reshape.inputs[0])
        if before is None or before.shape is None:
            continue
        moved = unique_name(act.outputs[0] + ":before_reshape", graph.value_names())
        graph.values[moved] = ValueInfo(moved, before.dtype, before.shape)
        act.inputs = [reshape.inputs[0]] + act.inputs[1:]
        reshape.inputs = [moved] + reshape.inputs[1:]
        reshape.outputs, act.outputs = [act.outputs[0]], [moved]
        graph.nodes.remove(act)
        graph.nodes.insert(graph.nodes.index(reshape), act)
        return True
    return False


def fuse_silu(graph: Graph) -> bool:
    """Mul(x, Sigmoid(x)) -> Silu(x): one activation the epilogue fusion can then take, where the
    pair is two passes over a tensor with two readers, which fusion never absorbs."""
    idx = ConsumerIndex(graph)
    producers = graph.producers()
    for mul in graph.nodes:
        if mul.op != "Mul" or len(mul.inputs) != 2:
            continue
        for k in (0, 1):
            sig = producers.get(mul.inputs[k])
            if sig is not None and sig.op == "Sigmoid" and sig.inputs[0] == mul.inputs[1 - k] and idx.sole_user(sig.outputs[0]) is mul:
                graph.nodes[graph.nodes.index(mul)] = Node("Silu", mul.name, [sig.inputs[0]], list(mul.outputs))
                graph.nodes.remove(sig)
                return True
    return False


def fuse(graph: Graph) -> Graph:
    from .recompose import recompose_gelu, recompose_layer_norm

    for rewrite in (recompose_gelu, recompose_layer_norm, fold_pad_into_conv, fold_affine_into_conv, fuse_silu,
                    sink_reshape_below_activation, fuse_epilogues, fuse_residual_through_reshape, fold_pad_into_max_pool):
        while rewrite(graph):
            pass
    return graph
