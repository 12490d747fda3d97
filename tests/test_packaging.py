"""Packaging: the explicit package list in pyproject.toml names every package folder, so a wheel
(what the Dockerfiles install) carries all of them under the kubetrt namespace."""
from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == listed, f"missing from pyproject packages: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_runtime_never_imports_tensorflow() -> None:
    import subprocess
    import sys

    code = "import sys, kubetrt.runtime, kubetrt.runtime.devices.cuda, kubetrt.runtime.devices.tensorrt; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
