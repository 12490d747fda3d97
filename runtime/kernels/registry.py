"""Kernel registry: one definition per op (its shape function, how it reads its operands) and
kernels per (op, device), so every device runs the same op table and shape arithmetic.

A kernel is a factory: given the static facts about one node (attributes, constant operands,
known input shapes, which operands it may overwrite, and on a device its context) it returns a
closure that runs the node. Work that depends only on static facts (weight re-layout, einsum
paths, axes) happens once, in the factory, not on every call.

Every op has a host kernel (the eager API, constant folding and device fallbacks need one), so
`register` defines an op and its host kernel together; `register_device` adds the kernel of a
device for an op already defined, and takes no shape function: the shape of an op does not
depend on the device that runs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, overload

import numpy as np

from ..errors import UnsupportedOpError

# Attribute key of a Mul inside a blocked region (passes/blocked.py): the operand that may arrive in
# the blocked layout, the other being per-channel scales (a colon never appears in ONNX names).
BLOCKED_OPERAND = "kubetrt:blocked_operand"
# A FusedConvNHWC marked so, with fewer input channels than a block (an image's), writes its
# result in the blocked layout itself, where a ToBlocked would otherwise reorder it (passes/blocked.py).
BLOCKED_RESULT = "kubetrt:blocked_result"
# A Transpose marked so returns a view of its input, not a copy: its readers are all matmuls,
# which take a strided operand as it is (passes/views.py `matmul_operands_as_views`).
TRANSPOSE_VIEW = "kubetrt:view"
# A Softmax marked so reads its input times this constant (passes/fusion.py `fold_scale_into_softmax`).
SOFTMAX_SCALE = "kubetrt:scale"


Shape = tuple[int, ...] | None  # None = unknown rank; -1 = unknown dim
Run = Callable[..., tuple[np.ndarray, ...]]

HOST = "host"


@dataclass
class KernelSpec:
    """Static facts about one node, as the compiler (or the eager API) knows them."""

    op: str
    name: str
    attrs: dict[str, Any]
    consts: list[np.ndarray | None]  # per input: its value if constant, else None
    shapes: list[Shape]
    dtypes: list[np.dtype | None]
    n_outputs: int = 1
    inplace: frozenset[int] = frozenset()  # operand indices the kernel may overwrite
    present: list[bool] = field(default_factory=list)  # False for omitted optional inputs
    ctx: Any = None  # the device's context for its kernels (cuda: kernels.cuda.DeviceContext); None on the host
    subgraphs: dict[str, Any] = field(default_factory=dict)  # GRAPH attributes compiled by the program compiler (control flow)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def const(self, i: int) -> np.ndarray | None:
        return self.consts[i] if i < len(self.consts) else None

    def has(self, i: int) -> bool:
        return i < len(self.present) and self.present[i]


OutputShapes = list[tuple[Shape, np.dtype | None]]  # per output: shape and dtype, where known
ShapeFn = Callable[[KernelSpec], OutputShapes]
Factory = Callable[[KernelSpec], Run]


@dataclass(frozen=True)
class OpDef:
    """What an op is on every device."""

    op: str
    shape_fn: ShapeFn
    params: frozenset[int] = frozenset()  # operands that are shape-like parameters (targets, axes, pads), not data
    shape_only: bool = False  # reads only its operands' shapes, never their values


@dataclass(frozen=True)
class KernelDef:
    """One device's kernel for an op."""

    op: str
    device: str
    factory: Factory
    own_consts: frozenset[int] = frozenset()  # constant operands the factory takes itself: callers pass None

    @property
    def shape_fn(self) -> ShapeFn:
        """The op's shape function: one per op, whichever device runs it."""
        return _OPS[self.op].shape_fn


_OPS: dict[str, OpDef] = {}
_KERNELS: dict[tuple[str, str], KernelDef] = {}


def _names(ops: str | Sequence[str]) -> list[str]:
    return [ops] if isinstance(ops, str) else list(ops)


def register(ops: str | Sequence[str], shape_fn: ShapeFn, params: frozenset[int] = frozenset(),
             shape_only: bool = False) -> Callable[[Factory], Factory]:
    """Define `ops` (their shape function and operand roles) with `factory` as their host kernel."""
    names = _names(ops)

    def deco(factory: Factory) -> Factory:
        for op in names:
            _OPS[op] = OpDef(op, shape_fn, params, shape_only)
            _KERNELS[(op, HOST)] = KernelDef(op, HOST, factory)
        return factory

    return deco


def register_device(ops: str | Sequence[str], device: str,
                    own_consts: frozenset[int] = frozenset()) -> Callable[[Factory], Factory]:
    """`factory` as the `device` kernel of `ops`, which `register` must have defined already."""
    if device == HOST:
        raise ValueError("host kernels define their ops: register them with register(ops, shape_fn)")
    names = _names(ops)
    undefined = [op for op in names if op not in _OPS]
    if undefined:
        raise ValueError(f"{device} kernels for {', '.join(undefined)}: no such op is defined; register its host kernel first")

    def deco(factory: Factory) -> Factory:
        for op in names:
            _KERNELS[(op, device)] = KernelDef(op, device, factory, own_consts)
        return factory

    return deco


def supported_ops(device: str = HOST) -> list[str]:
    return sorted(op for (op, dev) in _KERNELS if dev == device)


def _where(node: str | None) -> str:
    return f"node {node!r}: " if node else ""


def op_def(op: str, node: str | None = None) -> OpDef:
    try:
        return _OPS[op]
    except KeyError:
        raise UnsupportedOpError(f"{_where(node)}op {op} is not defined; defined: {', '.join(sorted(_OPS))}") from None


def lookup(op: str, device: str = HOST, node: str | None = None) -> KernelDef:
    try:
        return _KERNELS[(op, device)]
    except KeyError:
        raise UnsupportedOpError(
            f"{_where(node)}op {op} has no kernel on device {device}; supported: {', '.join(supported_ops(device))}"
        ) from None


# ---- attribute checks shared by many kernels ----

def refuse(spec: KernelSpec, what: str, supported: str) -> UnsupportedOpError:
    """The error for an attribute or operand combination this kernel does not compute."""
    return UnsupportedOpError(f"node {spec.name!r} ({spec.op}): {what}; supported: {supported}")


def check_attrs(spec: KernelSpec, known: set[str]) -> None:
    """Refuse attributes the op's kernel would ignore: a newer opset's meaning must not be dropped."""
    extra = sorted(set(spec.attrs) - known)
    if extra:
        raise refuse(spec, f"attributes {extra} are not understood", f"attributes {sorted(known) or 'none'}")


def flag(spec: KernelSpec, key: str, default: int = 0) -> bool:
    """A 0/1 attribute as a bool; anything else refused."""
    v = spec.attr(key, default)
    if v not in (0, 1):
        raise refuse(spec, f"{key}={v!r}", f"{key} 0 or 1")
    return bool(v)


# ---- shape-function helpers shared by many kernels ----

def broadcast(*shapes: Shape) -> Shape:
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)  # type: ignore[arg-type]
    out = []
    for dims in zip(*[(1,) * (rank - len(s)) + tuple(s) for s in shapes]):  # type: ignore[arg-type]
        known = {d for d in dims if d not in (1, -1)}
        if len(known) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(known.pop() if known else (-1 if -1 in dims else 1))
    return tuple(out)


def same_as_input(spec: KernelSpec) -> list[tuple[Shape, np.dtype | None]]:
    return [(spec.shapes[0], spec.dtypes[0])]


def broadcast_shape(spec: KernelSpec) -> list[tuple[Shape, np.dtype | None]]:
    return [(broadcast(*[s for s, p in zip(spec.shapes, spec.present) if p]), spec.dtypes[0])]


def broadcast_bool(spec: KernelSpec) -> list[tuple[Shape, np.dtype | None]]:
    return [(broadcast(*spec.shapes), np.dtype(bool))]


def unknown_outputs(spec: KernelSpec) -> list[tuple[Shape, np.dtype | None]]:
    return [(None, spec.dtypes[0] if spec.dtypes else None)] * spec.n_outputs


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


@overload
def ints(x: np.ndarray | Sequence[int]) -> list[int]: ...
@overload
def ints(x: None) -> None: ...
def ints(x: Any) -> list[int] | None:
    """An integer operand (axes, pads, shapes, sizes) as Python ints; an absent one stays None."""
    return None if x is None else [int(v) for v in np.asarray(x).reshape(-1)]
