"""Eager op API: run one ONNX op on NumPy arrays with the very kernels and shape functions the
compiled programs use, so eager and graph execution cannot drift apart.

    from kubetrt.runtime import ops
    y = ops.Conv(x, w, b, pads=[1, 1, 1, 1])
    y = ops.call("Softmax", x, axis=-1)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InputError
from .kernels import lookup, supported_ops
from .kernels.registry import KernelSpec


def call(op: str, *inputs: np.ndarray | None, n_outputs: int = 1, device: str = "host", ctx: Any = None,
         **attrs: Any) -> Any:
    """Run `op`; returns one array, or a tuple when the op has several outputs. A device other
    than the host needs its kernels' context (`ctx`, e.g. kernels.cuda.DeviceContext)."""
    kernel = lookup(op, device)
    arrays = [None if x is None else np.asarray(x) for x in inputs]
    spec = KernelSpec(
        op=op,
        name=f"eager:{op}",
        attrs=attrs,
        consts=list(arrays),  # eager operands are known values: kernels may specialise on them
        shapes=[None if x is None else tuple(x.shape) for x in arrays],
        dtypes=[None if x is None else x.dtype for x in arrays],
        n_outputs=n_outputs,
        present=[x is not None for x in arrays],
        ctx=ctx,
    )
    try:
        expected = kernel.shape_fn(spec)
    except (ValueError, TypeError, IndexError) as e:
        raise InputError(f"{op}: operands do not fit ({e}); shapes {[s for s in spec.shapes]}") from e
    outs = kernel.factory(spec)(*arrays)
    for i, ((shape, _), got) in enumerate(zip(expected, outs)):
        if shape is not None and (len(shape) != got.ndim or any(d not in (-1, g) for d, g in zip(shape, got.shape))):
            raise AssertionError(f"{op}: kernel output {i} has shape {got.shape}, its shape function says {shape}")
    return outs[0] if len(outs) == 1 else tuple(outs)


def __getattr__(name: str) -> Any:
    if name in supported_ops():
        return lambda *inputs, **attrs: call(name, *inputs, **attrs)
    raise AttributeError(f"kubetrt.runtime.ops has no op {name!r}; supported: {', '.join(supported_ops())}")
