"""The real helm binary (scripts/get-helm.sh puts it in .cache/bin) for tests that render or lint
the chart: import `helm` (a fixture) and `run`."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def helm() -> str:
    path = os.environ.get("KUBETRT_HELM") or str(REPO / ".cache" / "bin" / "helm")
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm not found at {path}: run scripts/get-helm.sh (or set KUBETRT_HELM)")
    return path


def run(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
