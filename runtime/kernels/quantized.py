"""Explicit quantization: QuantizeLinear and DequantizeLinear as ONNX defines them, and the integer
convolutions and matrix products (QConv, QConvNHWC, QMatMul) that runtime/passes/quantization.py
folds Q/DQ pairs into.

The integer ops take int8/uint8 activations and constant int8 weights with one scale per output
channel (symmetric: zero points are 0), and return float32 or, when the pass fused the next
QuantizeLinear, int8/uint8 requantized in the same oneDNN call, with bias, residual sum and
activation applied in float between accumulation and requantization.

A uint8 result is a non-negative int8 one (after ReLU or a non-negative Clip): it keeps int8's
range, 0..127, so it reads the same under the int8 scale and lets the next convolution use
oneDNN's u8 x s8 kernels. Without VNNI (AVX2, AVX-512 before Cascade Lake) those kernels add
adjacent u8 x s8 products in int16, which saturates once a source value exceeds 127. oneDNN's
convolutions guard signed sources themselves (they shift them to unsigned and halve the
weights); its matmuls do not. A convolution whose unsigned source can exceed 127 (a model's own
uint8 input) gets its weights rounded to 7 bits here, as onnxruntime's reduce_range does; a
matmul whose source can exceed 127 runs in float instead (these are the classifier heads and
GEMVs, a small part of a CNN's time).

Without the onednn extra the integer ops compute in float from the dequantized operands: the same
numbers up to float32 rounding, at float speed.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import activations, jit, onednn
from .nhwc import _nhwc_conv_shape, conv_nhwc
from .nn import _conv_shape, _matmul_shape, conv, geometry_by_input_size, matmul
from .registry import KernelSpec, OutputShapes, Run, check_attrs, norm_axis, refuse, register

QUANT_DTYPES = {"int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8)}
ONNX_DTYPES = {2: np.dtype(np.uint8), 3: np.dtype(np.int8)}  # TensorProto data types Q/DQ may name
BOUNDED = 127  # the largest value a int8-ranged uint8 tensor holds
MIN_INTEGER_ROWS = 4  # fewer rows than this: a matrix-vector product, faster in float (bench/runtime.py --int8)


def _q_dtype(spec: KernelSpec) -> np.dtype | None:
    """QuantizeLinear's output type: output_dtype, else the zero point's, else uint8 (the spec's default)."""
    code = spec.attr("output_dtype", 0)
    if code:
        if code not in ONNX_DTYPES:
            raise refuse(spec, f"output_dtype {code}", "uint8 (2) or int8 (3)")
        return ONNX_DTYPES[code]
    if spec.has(2):
        return spec.dtypes[2]
    return np.dtype(np.uint8)


def _q_shape(spec: KernelSpec) -> OutputShapes:
    return [(spec.shapes[0], _q_dtype(spec))]


def _dq_shape(spec: KernelSpec) -> OutputShapes:
    return [(spec.shapes[0], spec.dtypes[1])]


def _per_axis(spec: KernelSpec) -> Callable[[np.ndarray, int], np.ndarray]:
    """How a scale or zero point broadcasts against the data: whole tensor, or along `axis`."""
    check_attrs(spec, {"axis", "saturate", "block_size", "output_dtype"})
    if spec.attr("block_size", 0):
        raise refuse(spec, f"block_size={spec.attr('block_size')}", "per-tensor or per-axis quantization (block_size 0)")
    axis = spec.attr("axis", 1)

    def shaped(p: np.ndarray, rank: int) -> np.ndarray:
        if p.ndim == 0 or p.size == 1:
            return p.reshape(())
        shape = [1] * rank
        shape[norm_axis(axis, rank)] = p.size
        return p.reshape(shape)
    return shaped


@register("QuantizeLinear", _q_shape)
def quantize_linear(spec: KernelSpec) -> Run:
    """y = saturate(round_half_even(x / scale) + zero_point)."""
    dtype = _q_dtype(spec)
    if dtype is None or dtype not in QUANT_DTYPES.values():
        raise refuse(spec, f"output type {dtype}", "int8 or uint8")
    shaped = _per_axis(spec)
    info = np.iinfo(dtype)

    def run(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if jit.AVAILABLE and scale.size == 1 and (zero_point is None or zero_point.size == 1) and x.dtype == np.float32:
            return (jit.quantize(x, float(scale.reshape(-1)[0]), 0 if zero_point is None else int(zero_point.reshape(-1)[0]), dtype),)
        y = np.rint(x / shaped(scale, x.ndim).astype(x.dtype, copy=False))
        if zero_point is not None and np.any(zero_point):
            y += shaped(zero_point, x.ndim)
        np.clip(y, info.min, info.max, out=y)
        return (y.astype(dtype),)
    return run


@register("DequantizeLinear", _dq_shape)
def dequantize_linear(spec: KernelSpec) -> Run:
    """y = (x - zero_point) * scale, in the scale's float type."""
    shaped = _per_axis(spec)
    if spec.dtypes[0] is not None and spec.dtypes[0] not in (np.int8, np.uint8, np.int32):
        raise refuse(spec, f"input type {spec.dtypes[0]}", "int8, uint8 or int32")

    def run(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        y = x.astype(scale.dtype)
        if zero_point is not None and np.any(zero_point):
            y -= shaped(zero_point, x.ndim).astype(scale.dtype)
        y *= shaped(scale, x.ndim)
        return (y,)
    return run


# ---------------------------------------------------------------- integer convolution / matmul

def _result_dtype(spec: KernelSpec) -> np.dtype:
    name = spec.attr("y_dtype")
    return np.dtype(np.float32) if name is None else QUANT_DTYPES[name]


def _with_result_dtype(shape_fn: Callable[[KernelSpec], OutputShapes]) -> Callable[[KernelSpec], OutputShapes]:
    def shape(spec: KernelSpec) -> OutputShapes:
        return [(shape_fn(spec)[0][0], _result_dtype(spec))]
    return shape


def quantization(spec: KernelSpec, w_scale: np.ndarray) -> onednn.Quantized:
    """The integer side of a QConv/QMatMul node, from the attributes the pass set."""
    residual_scale = spec.attr("residual_scale")
    return onednn.Quantized(
        src=spec.dtypes[0] or np.dtype(np.int8), src_scale=float(spec.attr("x_scale")), w_scales=w_scale,
        dst=_result_dtype(spec), dst_scale=spec.attr("y_scale"),
        residual=None if residual_scale is None else spec.dtypes[3], residual_scale=1.0 if residual_scale is None else float(residual_scale))


def _saturation_safe(spec: KernelSpec) -> bool:
    """True where oneDNN's integer kernels cannot saturate on this node (see the module docstring)."""
    if onednn.EXACT_INT8:
        return True
    if spec.dtypes[0] == np.uint8:
        return bool(spec.attr("x_max", 255) <= BOUNDED)
    return spec.op != "QMatMul"  # oneDNN's convolutions compensate signed sources, its matmuls do not


def _weights(spec: KernelSpec) -> tuple[np.ndarray, np.ndarray]:
    """Int8 weights and their per-output-channel scales."""
    w = spec.const(1)
    if w is None or w.dtype != np.int8:
        raise refuse(spec, "weights that are not a constant int8 tensor", "constant int8 weights")
    return w, np.asarray(spec.attr("w_scale"), dtype=np.float32).reshape(-1)


def _narrowed(w: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weights rounded to 7 bits (and their scales doubled) unless they already fit."""
    if np.abs(w.astype(np.int16)).max(initial=0) <= 64:
        return w, scale
    return np.rint(w / np.float32(2)).astype(np.int8), scale * 2


def _post_op(spec: KernelSpec) -> onednn.Eltwise | None | bool:
    """The activation, clamped to 0..127 steps of the output scale for a uint8 result."""
    act = spec.attrs.get("activation")
    if spec.attr("y_dtype") != "uint8":
        return onednn.activation_post_op(act)
    form = activations.scalar_form(act)
    lo, hi = (0.0, np.inf) if form is None else (form[1], form[2])
    return ("eltwise_clip_v2", max(lo, 0.0), min(hi, BOUNDED * float(spec.attr("y_scale"))))


def _float_twin(spec: KernelSpec, op: str, w: np.ndarray, scale: np.ndarray, axis: int) -> Run:
    """The node computed by the float kernel of the same op on dequantized operands."""
    shape = [1] * w.ndim
    shape[axis] = -1
    wf = (w.astype(np.float32) * scale.reshape(shape)).astype(np.float32)
    consts = [None, wf] + list(spec.consts[2:3])
    f32 = np.dtype(np.float32)
    float_spec = KernelSpec(op, spec.name, {k: v for k, v in spec.attrs.items() if k in _CONV_ATTRS or k == "activation"},
                            consts, spec.shapes, [f32, f32, f32, f32], present=spec.present)
    kernel = conv_nhwc(float_spec) if op == "FusedConvNHWC" else conv(float_spec) if op == "FusedConv" else matmul(float_spec)
    x_scale = np.float32(spec.attr("x_scale"))
    r_scale = spec.attr("residual_scale")
    y_scale, y_dtype = spec.attr("y_scale"), _result_dtype(spec)

    def run(x: np.ndarray, _w: Any, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        xf = x.astype(np.float32) * x_scale
        if residual is not None and r_scale is not None:
            residual = residual.astype(np.float32) * np.float32(r_scale)
        (y,) = kernel(xf, wf, bias, residual)
        if y_scale is None:
            return (y,)
        return (np.clip(np.rint(y / np.float32(y_scale)), 0 if y_dtype == np.uint8 else -128, BOUNDED).astype(y_dtype),)
    return run


_CONV_ATTRS = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}
_Q_ATTRS = {"x_scale", "w_scale", "y_scale", "y_dtype", "residual_scale", "activation", "x_max"}


@register("QConv", _with_result_dtype(_conv_shape))
@register("QConvNHWC", _with_result_dtype(_nhwc_conv_shape))
def qconv(spec: KernelSpec) -> Run:
    """QConv(x_int, w_int8, bias_f32, [residual]) in NCHW, QConvNHWC the same in NHWC."""
    check_attrs(spec, _CONV_ATTRS | _Q_ATTRS)
    nhwc = spec.op == "QConvNHWC"
    w, scale = _weights(spec)
    if not _saturation_safe(spec):
        w, scale = _narrowed(w, scale)
    o, _, kh, kw = w.shape
    group = spec.attr("group", 1)
    post = _post_op(spec)
    if not onednn.AVAILABLE or post is False:
        return _float_twin(spec, "FusedConvNHWC" if nhwc else "FusedConv", w, scale, 0)
    bias = spec.const(2) if spec.has(2) else None
    if spec.has(2) and bias is None:
        raise refuse(spec, "a bias that is not constant", "a constant float32 bias")
    dnnl = onednn.Conv2D(w, bias, group, list(spec.attr("strides") or [1, 1]), list(spec.attr("dilations") or [1, 1]),
                         post, residual=spec.has(3), layout="nhwc" if nhwc else "nchw", name=spec.name,  # type: ignore[arg-type]
                         quant=quantization(spec, scale))
    residual_inplace = 3 in spec.inplace
    geometry = geometry_by_input_size(spec, (kh, kw))

    def run(x: np.ndarray, _w: Any, _bias: Any = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        _, _, b, e, oh, ow = geometry(*(x.shape[1:3] if nhwc else x.shape[2:4]))
        return (dnnl(x, oh, ow, b, e, residual, overwrite_residual=residual_inplace),)
    return run


@register("QMatMul", _with_result_dtype(_matmul_shape))
def qmatmul(spec: KernelSpec) -> Run:
    """QMatMul(a_int, w_int8 (K, N), bias_f32, [residual]) = act(a @ w + bias + residual)."""
    check_attrs(spec, _Q_ATTRS)
    w, scale = _weights(spec)
    post = _post_op(spec)
    in_float = _float_twin(spec, "FusedMatMul", w, scale, 1)
    if not onednn.AVAILABLE or post is False or not _saturation_safe(spec):
        return in_float
    bias = spec.const(2) if spec.has(2) else None
    if spec.has(2) and (bias is None or bias.ndim != 1):
        raise refuse(spec, "a bias that is not a constant vector", "a constant float32 bias of shape (N,)")
    dense = onednn.Dense(w, bias, post, residual=spec.has(3), name=spec.name, quant=quantization(spec, scale))  # type: ignore[arg-type]
    residual_inplace = 3 in spec.inplace

    def run(a: np.ndarray, _w: Any, bias_: Any = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if a.size < MIN_INTEGER_ROWS * a.shape[-1]:  # a GEMV: oneDNN's integer path costs more than float
            return in_float(a, None, bias_, residual)
        return (dense(a, residual, overwrite_residual=residual_inplace),)
    return run
