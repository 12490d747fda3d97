"""kubetrt.runtime: lowered programs, kernels, executors and device runtimes. Never imports TensorFlow.

The model, package and eager-op exports load on first use: light modules of this package (targets,
errors) are imported by the operator, which must not pull in NumPy, ONNX or Numba to name a target.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import DeviceUnavailableError, InputError, KernelError, RuntimeModelError, UnsupportedOpError

if TYPE_CHECKING:
    from . import ops
    from .model import Model, load_model
    from .kernels.omp import release_team
    from .package import PackageError, TensorSpec

# export -> (submodule, attribute of it; None for the submodule itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "load_model": (".model", "load_model"),
    "Model": (".model", "Model"),
    "release_team": (".kernels.omp", "release_team"),
    "ops": (".ops", None),
    "PackageError": (".package", "PackageError"),
    "TensorSpec": (".package", "TensorSpec"),
}

__all__ = [
    "load_model", "Model", "release_team", "ops", "TensorSpec", "InputError", "KernelError", "PackageError",
    "RuntimeModelError", "UnsupportedOpError", "DeviceUnavailableError",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
