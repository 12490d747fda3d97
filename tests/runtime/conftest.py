"""Fixtures the runtime tests share."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.kernels import onednn


@pytest.fixture
def onednn_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Records (op kind, input shape) of every convolution, matmul and pooling oneDNN ran from a
    plan step (a chain's calls run without Python and are not seen)."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    real = onednn.Site.__call__

    def spy(self: onednn.Site, x: np.ndarray, *a: Any, **k: Any) -> np.ndarray:
        calls.append((self.op.kind, x.shape))
        return real(self, x, *a, **k)
    monkeypatch.setattr(onednn.Site, "__call__", spy)
    return calls
