"""kubetrt.runtime: lowered programs, kernels, executors and device runtimes. Never imports TensorFlow."""
from .errors import DeviceUnavailableError, InputError, KernelError, RuntimeModelError, UnsupportedOpError
from . import ops
from .model import Model, load_model
from .package import PackageError, TensorSpec

__all__ = [
    "load_model", "Model", "ops", "TensorSpec", "InputError", "KernelError", "PackageError",
    "RuntimeModelError", "UnsupportedOpError", "DeviceUnavailableError",
]
