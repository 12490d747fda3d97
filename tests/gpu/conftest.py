"""The real GPU boundary for tests that need one: skipped where CuPy or a GPU is absent."""
from __future__ import annotations

import pytest
from kubetrt.runtime.devices.cuda import CudaRuntime, CupyBackend
from kubetrt.runtime.errors import DeviceUnavailableError


@pytest.fixture(scope="module")
def gpu() -> CudaRuntime:
    rt = CudaRuntime(CupyBackend())
    try:
        rt.check_available()
    except DeviceUnavailableError as e:
        pytest.skip(f"no CUDA GPU usable here: {e}")
    return rt
