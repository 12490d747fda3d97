"""Make `kubetrt` importable from a plain checkout (GPU machines get the repo copied, not
pip-installed), or from another checkout (a baseline to compare with): its folders are found under
their package names, exactly as that checkout's pyproject maps them."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dirs(repo: Path) -> dict[str, Path]:
    """Package name -> folder, as the checkout's pyproject.toml maps them (package-dir)."""
    text = (repo / "pyproject.toml").read_text()
    table = re.search(r"^package-dir\s*=\s*\{(.*)\}\s*$", text, re.M)
    if table is None:
        raise SystemExit(f"{repo}/pyproject.toml has no package-dir table")
    return {name: repo / folder for name, folder in re.findall(r'"([\w.]+)"\s*=\s*"([^"]+)"', table.group(1))}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped packages in one checkout, ahead of whatever is installed."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.dirs.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def use_checkout(repo: Path) -> None:
    """Import kubetrt from `repo` in this process (before anything of kubetrt is imported)."""
    if any(m == "kubetrt" or m.startswith("kubetrt.") for m in sys.modules):
        raise RuntimeError("kubetrt is already imported in this process; choose the checkout first")
    sys.meta_path.insert(0, _CheckoutFinder(package_dirs(repo)))


def ensure_kubetrt() -> None:
    try:
        import kubetrt.runtime  # noqa: F401
    except ImportError:
        for name in [m for m in sys.modules if m == "kubetrt" or m.startswith("kubetrt.")]:
            del sys.modules[name]
        use_checkout(REPO)


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


CHECKOUT_ENV = "KUBETRT_BENCH_CHECKOUT"  # set: this process imports kubetrt from that checkout

if os.environ.get(CHECKOUT_ENV):
    use_checkout(Path(os.environ[CHECKOUT_ENV]))
else:
    ensure_kubetrt()
