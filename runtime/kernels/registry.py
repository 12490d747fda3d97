"""Kernel registry keyed by (op, device), with shape functions shared by eager and graph paths.

A kernel is a factory: given the static facts about one node (attributes, constant operands,
known input shapes, which operands it may overwrite) it returns a closure that runs the node.
Work that depends only on static facts (weight re-layout, einsum paths, axes) happens once, in
the factory, not on every call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import UnsupportedOpError

Shape = tuple[int, ...] | None  # None = unknown rank; -1 = unknown dim
Run = Callable[..., tuple[np.ndarray, ...]]


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

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def const(self, i: int) -> np.ndarray | None:
        return self.consts[i] if i < len(self.consts) else None

    def has(self, i: int) -> bool:
        return i < len(self.present) and self.present[i]


ShapeFn = Callable[[KernelSpec], list[tuple[Shape, np.dtype | None]]]
Factory = Callable[[KernelSpec], Run]


@dataclass(frozen=True)
class KernelDef:
    op: str
    device: str
    factory: Factory
    shape_fn: ShapeFn


_REGISTRY: dict[tuple[str, str], KernelDef] = {}


def register(ops: str | Sequence[str], shape_fn: ShapeFn, device: str = "host") -> Callable[[Factory], Factory]:
    names = [ops] if isinstance(ops, str) else list(ops)

    def deco(factory: Factory) -> Factory:
        for op in names:
            _REGISTRY[(op, device)] = KernelDef(op, device, factory, shape_fn)
        return factory

    return deco


def supported_ops(device: str = "host") -> list[str]:
    return sorted(op for (op, dev) in _REGISTRY if dev == device)


def lookup(op: str, device: str = "host", node: str | None = None) -> KernelDef:
    try:
        return _REGISTRY[(op, device)]
    except KeyError:
        where = f"node {node!r}: " if node else ""
        raise UnsupportedOpError(
            f"{where}op {op} has no kernel on device {device}; supported: {', '.join(supported_ops(device))}"
        ) from None


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
