"""Kernels of every device in one registry; importing this package registers them all."""
from . import attention, elementwise, nhwc, nn, reduce, tensor  # noqa: F401  host kernels: they define the ops
from . import indexing, resize, normalization, conv_transpose, recurrent, control_flow, quantized, squeeze_excite  # noqa: F401
from . import cuda  # noqa: F401  device kernels of ops defined above, so after them
from .registry import KernelDef, KernelSpec, OpDef, lookup, op_def, register, register_device, supported_ops

__all__ = ["KernelDef", "KernelSpec", "OpDef", "lookup", "op_def", "register", "register_device", "supported_ops"]
