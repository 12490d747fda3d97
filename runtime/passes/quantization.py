"""Explicit quantization: run a Q/DQ graph's convolutions and matrix products on integers.

A Q/DQ model (what TensorRT consumes) says where values are rounded to int8, but every op in it
still computes in float between DequantizeLinear and QuantizeLinear. Here, before constants are
folded (which would turn the int8 weights back into float ones):

1. `absorb_dequantize`: Conv / MatMul reading DequantizeLinear of an int8 activation and of
   constant int8 weights becomes QConv / QMatMul on the integers themselves, carrying the scales;
   an int32 bias with its DequantizeLinear becomes the float bias it stands for.
2. `drop_fake_quantization`: the remaining QuantizeLinear -> DequantizeLinear round trips on float
   paths (around ReLU, Add, pooling, Softmax) are removed: they only round a float value to the
   int8 grid, which float ops between integer convolutions do not need; results move closer to
   float, never further.

After fusion has given QConv / QMatMul their bias, residual and activation epilogues,
`requantize` folds the QuantizeLinear that follows each of them into the call (an int8 result,
uint8 after a non-negative activation), passes int8 residuals to the sums that read them, and
re-inserts a DequantizeLinear only where a float op still needs the value.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph import Graph, Node, unique_name
from ..kernels import activations
from ..kernels.quantized import QUANT_DTYPES

INT8_TYPES = tuple(QUANT_DTYPES.values())
INTEGER_OPS = ("QConv", "QMatMul")
NON_NEGATIVE_MIN = 0.0


@dataclass(frozen=True)
class Scale:
    """A Q or DQ node's constant scale (a scalar or one per channel) with zero points all 0."""

    values: np.ndarray
    axis: int

    @property
    def per_tensor(self) -> bool:
        return self.values.size == 1

    @property
    def scalar(self) -> float:
        return float(self.values.reshape(-1)[0])


def symmetric_scale(graph: Graph, node: Node) -> Scale | None:
    """The scale of a QuantizeLinear/DequantizeLinear node whose scale and zero point are
    constants and whose zero points are all 0; None for anything else."""
    if node.op not in ("QuantizeLinear", "DequantizeLinear") or node.attrs.get("block_size", 0):
        return None
    scale = graph.constants.get(node.inputs[1])
    if scale is None or scale.dtype != np.float32:
        return None
    zp_name = node.inputs[2] if len(node.inputs) > 2 else ""
    if zp_name:
        zp = graph.constants.get(zp_name)
        if zp is None or np.any(zp):
            return None
    return Scale(scale, int(node.attrs.get("axis", 1)))


def _dtype(graph: Graph, value: str) -> np.dtype | None:
    if value in graph.constants:
        return graph.constants[value].dtype
    v = graph.values.get(value)
    return None if v is None else v.dtype


def _integer_source(graph: Graph, producers: dict[str, Node], value: str) -> tuple[str, float] | None:
    """(int8 tensor, its scale) when `value` is a per-tensor DequantizeLinear of a computed int8/uint8 tensor."""
    dq = producers.get(value)
    if dq is None or dq.op != "DequantizeLinear":
        return None
    s = symmetric_scale(graph, dq)
    if s is None or not s.per_tensor or dq.inputs[0] in graph.constants or _dtype(graph, dq.inputs[0]) not in INT8_TYPES:
        return None
    return dq.inputs[0], s.scalar


def _integer_weights(graph: Graph, producers: dict[str, Node], value: str, channel_axis: int) -> tuple[str, list[float]] | None:
    """(constant int8 weights, one scale per output channel) for DequantizeLinear of constant int8 weights."""
    dq = producers.get(value)
    if dq is None or dq.op != "DequantizeLinear":
        return None
    s = symmetric_scale(graph, dq)
    w = graph.constants.get(dq.inputs[0])
    if s is None or w is None or w.dtype != np.int8:
        return None
    channels = w.shape[channel_axis]
    if s.per_tensor:
        return dq.inputs[0], [s.scalar] * channels
    if s.axis % w.ndim != channel_axis or s.values.size != channels:
        return None
    return dq.inputs[0], [float(v) for v in s.values.reshape(-1)]


def _float_bias(graph: Graph, producers: dict[str, Node], value: str, taken: set[str]) -> str | None:
    """A float constant bias: the value itself, or an int32 bias times its DequantizeLinear scale."""
    if not value or value in graph.constants:
        return value
    dq = producers.get(value)
    s = None if dq is None else symmetric_scale(graph, dq)
    q = None if dq is None else graph.constants.get(dq.inputs[0])
    if s is None or q is None or q.dtype != np.int32:
        return None
    shaped = s.values.reshape(-1) if not s.per_tensor else s.values.reshape(())
    name = unique_name(f"{value}:float", taken)
    graph.constants[name] = (q.astype(np.float64) * shaped).astype(np.float32)
    return name


def absorb_dequantize(graph: Graph) -> Graph:
    """Conv/MatMul/Gemm over DequantizeLinear'd int8 operands -> QConv/QMatMul over the int8 operands."""
    producers = graph.producers()
    taken = graph.value_names()
    for k, node in enumerate(graph.nodes):
        if node.op not in ("Conv", "MatMul", "Gemm") or len(node.outputs) != 1:
            continue
        replacement = _integer_node(graph, producers, node, taken)
        if replacement is not None:
            graph.nodes[k] = replacement
    _remove_unused(graph, "DequantizeLinear")
    return graph


def _integer_node(graph: Graph, producers: dict[str, Node], node: Node, taken: set[str]) -> Node | None:
    source = _integer_source(graph, producers, node.inputs[0])
    if source is None:
        return None
    transposed = node.op == "Gemm" and bool(node.attrs.get("transB", 0))
    if node.op == "Gemm" and (node.attrs.get("transA", 0) or node.attrs.get("alpha", 1.0) != 1.0 or node.attrs.get("beta", 1.0) != 1.0):
        return None
    weights = _integer_weights(graph, producers, node.inputs[1], 0 if node.op == "Conv" or transposed else 1)
    if weights is None:
        return None
    w_name, w_scale = weights
    w = graph.constants[w_name]
    if w.ndim != (4 if node.op == "Conv" else 2):
        return None
    if transposed:  # QMatMul takes (K, N)
        w_name = unique_name(f"{w_name}:transposed", taken)
        graph.constants[w_name] = np.ascontiguousarray(w.T)
    bias = _float_bias(graph, producers, node.inputs[2] if len(node.inputs) > 2 else "", taken)
    if bias is None or (bias and node.op == "Gemm" and graph.constants[bias].ndim != 1):
        return None
    attrs = {k: v for k, v in node.attrs.items() if node.op == "Conv"} | {"x_scale": source[1], "w_scale": w_scale}
    op = "QConv" if node.op == "Conv" else "QMatMul"
    inputs = [source[0], w_name] + ([bias] if bias or node.op == "Conv" else [])
    return Node(op, node.name, inputs, list(node.outputs), attrs)


def drop_fake_quantization(graph: Graph) -> Graph:
    """DequantizeLinear(QuantizeLinear(x)) with the same scale, on a float path -> x."""
    producers = graph.producers()
    outputs = graph.output_names()
    renamed: dict[str, str] = {}
    kept = []
    for node in graph.nodes:
        q = producers.get(node.inputs[0]) if node.op == "DequantizeLinear" else None
        if q is not None and q.op == "QuantizeLinear" and node.outputs[0] not in outputs and _same_scale(graph, q, node):
            renamed[node.outputs[0]] = q.inputs[0]
            source = producers.get(q.inputs[0])
            if source is not None and source.op in INTEGER_OPS:  # the scale the model gave this result
                source.attrs = dict(source.attrs, y_scale_hint=symmetric_scale(graph, q).scalar)  # type: ignore[union-attr]
            continue
        kept.append(node)
    for node in kept:
        node.inputs = [renamed.get(i, i) for i in node.inputs]
    graph.nodes = kept
    _remove_unused(graph, "QuantizeLinear")
    return graph


def _same_scale(graph: Graph, a: Node, b: Node) -> bool:
    sa, sb = symmetric_scale(graph, a), symmetric_scale(graph, b)
    return sa is not None and sb is not None and sa.per_tensor and sb.per_tensor and sa.scalar == sb.scalar


def _remove_unused(graph: Graph, op: str) -> None:
    """Drop `op` nodes nothing reads any more (the absorbed or dropped halves of Q/DQ pairs)."""
    while True:
        used = {i for n in graph.nodes for i in n.inputs} | graph.output_names()
        dead = [n for n in graph.nodes if n.op == op and not any(o in used for o in n.outputs)]
        if not dead:
            return
        graph.nodes = [n for n in graph.nodes if n not in dead]


def prepare(graph: Graph) -> Graph:
    """Steps 1 and 2, before constant folding; nothing happens to a graph without Q/DQ."""
    if not any(n.op == "DequantizeLinear" for n in graph.nodes):
        return graph
    return drop_fake_quantization(absorb_dequantize(graph))


# ---------------------------------------------------------------- after fusion

def _non_negative(node: Node) -> bool:
    form = activations.scalar_form(node.attrs.get("activation"))
    return form is not None and form[0] == activations.SCALAR_CLAMP and form[1] >= NON_NEGATIVE_MIN


def requantize(graph: Graph) -> Graph:
    """Fold each integer op's following QuantizeLinear into it; int8 residuals into the sums."""
    if not any(n.op in INTEGER_OPS for n in graph.nodes):
        return graph
    while _requantize_one(graph):
        pass
    _dequantize_float_residuals(graph)
    _quantize_float_residuals(graph)
    for node in graph.nodes:
        node.attrs.pop("y_scale_hint", None)
    return graph


def _requantize_one(graph: Graph) -> bool:
    users = graph.consumers()
    outputs = graph.output_names()
    for node in graph.nodes:
        if node.op not in INTEGER_OPS or "y_scale" in node.attrs or node.outputs[0] in outputs:
            continue
        readers = users.get(node.outputs[0], [])
        quantizers = [r for r in readers if r.op == "QuantizeLinear"]
        residual_reads = [r for r in readers if r.op in INTEGER_OPS and len(r.inputs) > 3 and r.inputs[3] == node.outputs[0]
                          and r.inputs[0] != node.outputs[0]]
        if not readers or len(quantizers) + len(residual_reads) != len(readers):
            continue
        if quantizers:
            scales = {s.scalar if s is not None and s.per_tensor else None for s in (symmetric_scale(graph, q) for q in quantizers)}
            dtypes = {_dtype(graph, q.outputs[0]) for q in quantizers}
        else:  # only sums read it: requantize at the scale the model had given it
            scales, dtypes = {node.attrs.get("y_scale_hint")}, {np.dtype(np.int8)}
        if len(scales) != 1 or None in scales or dtypes != {np.dtype(np.int8)}:
            continue
        (scale,) = scales
        kept = quantizers[0].outputs[0] if quantizers else node.outputs[0]
        unsigned = _non_negative(node)
        node.attrs = dict(node.attrs, y_scale=scale, y_dtype="uint8" if unsigned else "int8")
        node.outputs = [kept]
        for q in quantizers[1:]:
            _rename_uses(graph, q.outputs[0], kept)
        graph.nodes = [n for n in graph.nodes if n not in quantizers]
        for r in residual_reads:
            r.inputs[3] = kept
            r.attrs = dict(r.attrs, residual_scale=scale)
        if unsigned:  # tells the reading integer ops their source stays within 0..127
            for r in graph.nodes:
                if r.op in INTEGER_OPS and r.inputs[0] == kept:
                    r.attrs = dict(r.attrs, x_max=127)
        _set_dtype(graph, kept, np.dtype(np.uint8) if unsigned else np.dtype(np.int8))
        return True
    return False


def _dequantize_float_residuals(graph: Graph) -> None:
    """An integer residual summed into a float result goes through DequantizeLinear first:
    oneDNN sums in place only into a destination of the residual's width."""
    taken = graph.value_names()
    for node in list(graph.nodes):
        if node.op in INTEGER_OPS and "residual_scale" in node.attrs and "y_scale" not in node.attrs:
            _convert_residual(graph, node, "DequantizeLinear", float(node.attrs["residual_scale"]), taken)
            node.attrs = {k: v for k, v in node.attrs.items() if k != "residual_scale"}


def _quantize_float_residuals(graph: Graph) -> None:
    """A float residual summed into an integer result goes through QuantizeLinear first, at the
    scale the model gave it, else at the result's."""
    taken = graph.value_names()
    producers = graph.producers()
    for node in list(graph.nodes):
        if node.op not in INTEGER_OPS or len(node.inputs) < 4 or not node.inputs[3] or "y_scale" not in node.attrs \
                or "residual_scale" in node.attrs:
            continue
        source = producers.get(node.inputs[3])
        value = float((source.attrs if source is not None else {}).get("y_scale_hint", node.attrs["y_scale"]))
        _convert_residual(graph, node, "QuantizeLinear", value, taken)
        node.attrs = dict(node.attrs, residual_scale=value)


def _convert_residual(graph: Graph, node: Node, op: str, scale: float, taken: set[str]) -> None:
    """Insert `op` (QuantizeLinear or DequantizeLinear, symmetric, at `scale`) on `node`'s residual."""
    scale_name = unique_name(f"{node.name}:residual_scale", taken)
    graph.constants[scale_name] = np.array(scale, dtype=np.float32)
    inputs = [node.inputs[3], scale_name]
    if op == "QuantizeLinear":  # its zero point's type is its output type
        inputs.append(unique_name(f"{node.name}:residual_zero_point", taken))
        graph.constants[inputs[-1]] = np.array(0, dtype=np.int8)
    out = unique_name(f"{node.inputs[3]}:{'int8' if op == 'QuantizeLinear' else 'float'}", taken)
    verb = "quantize" if op == "QuantizeLinear" else "dequantize"
    graph.nodes.insert(graph.nodes.index(node), Node(op, unique_name(f"{node.name}:{verb}_residual", taken), inputs, [out]))
    node.inputs[3] = out


def _rename_uses(graph: Graph, old: str, new: str) -> None:
    for n in graph.nodes:
        n.inputs = [new if i == old else i for i in n.inputs]
    for o in graph.outputs:
        if o.name == old:
            o.name = new


def _set_dtype(graph: Graph, value: str, dtype: np.dtype) -> None:
    info = graph.values.get(value)
    if info is not None:
        info.dtype = dtype
