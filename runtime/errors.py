"""Runtime errors: each names the tensor or node at fault and what was expected."""
from __future__ import annotations


class RuntimeModelError(ValueError):
    """Base for errors raised while loading or running a model."""


class InputError(RuntimeModelError):
    """A request's tensors do not match the model's inputs (name, dtype or shape)."""


class UnsupportedOpError(RuntimeModelError):
    """The graph has an op with no kernel on the chosen device."""


class KernelError(RuntimeModelError):
    """A kernel failed while running; carries the node so the failure is traceable."""


class DeviceUnavailableError(RuntimeError):
    """The requested device runtime cannot run on this node (missing library or hardware)."""
