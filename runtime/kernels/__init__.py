"""Host kernels; importing this package registers them all."""
from . import elementwise, nhwc, nn, reduce, tensor  # noqa: F401
from .registry import KernelDef, KernelSpec, lookup, register, supported_ops

__all__ = ["KernelDef", "KernelSpec", "lookup", "register", "supported_ops"]
