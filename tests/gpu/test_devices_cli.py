"""`kubetrt devices` and the import guards: without cupy or tensorrt everything imports and the
CLI says which library is missing and how to get it."""
from __future__ import annotations

import subprocess
import sys

import pytest
from kubetrt.runtime.devices import available_devices, get_device, resolve_device
from kubetrt.runtime.devices import cuda as cuda_mod
from kubetrt.runtime.errors import DeviceUnavailableError

from kubetrt.cli import main


@pytest.fixture
def no_gpu_libs(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(cuda_mod, "RUNTIME", cuda_mod.CudaRuntime())


def test_devices_command_lists_reasons(no_gpu_libs, capsys) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tensorrt: unavailable: the tensorrt Python package is not installed")
    assert out[1] == "cuda: unavailable: cupy is not installed (pip install kubetrt[gpu])"
    assert out[2].startswith("host: available (cpu, numpy")
    assert out[3] == "--device auto -> host"


def test_cuda_check_available_raises_device_unavailable(no_gpu_libs) -> None:
    with pytest.raises(DeviceUnavailableError, match="cupy is not installed"):
        get_device("cuda").check_available()
    assert available_devices()["cuda"] == cuda_mod.CUPY_MISSING
    assert resolve_device("auto") == "host"


def test_gpu_modules_import_without_gpu_libraries() -> None:
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['tensorrt'] = None\n"
            "import kubetrt.runtime.devices.cuda, kubetrt.runtime.devices.tensorrt, kubetrt.runtime.partition, kubetrt.runtime.fp16")
    subprocess.run([sys.executable, "-c", code], check=True)
