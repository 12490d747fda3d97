"""Make `kubetrt.runtime` importable from a plain checkout (GPU machines get the repo copied, not
pip-installed): register the folders under their package names, exactly as pyproject maps them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ensure_kubetrt() -> None:
    try:
        import kubetrt.runtime  # noqa: F401

        return
    except ImportError:
        pass
    for name, folder in (("kubetrt", "kubetrt"), ("kubetrt.runtime", "runtime")):
        if name in sys.modules:
            continue
        path = REPO / folder
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    sys.modules["kubetrt"].runtime = sys.modules["kubetrt.runtime"]  # type: ignore[attr-defined]


def cuda_runtime_or_exit(script: str):  # type: ignore[no-untyped-def]
    """The cuda device runtime, or exit 2 with one line saying why this node cannot run it."""
    from kubetrt.runtime.devices.cuda import CudaRuntime
    from kubetrt.runtime.errors import DeviceUnavailableError

    rt = CudaRuntime()
    try:
        rt.check_available()
    except DeviceUnavailableError as e:
        print(f"{Path(script).name}: cuda runtime unavailable: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return rt


ensure_kubetrt()
