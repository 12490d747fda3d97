"""Fixtures the runtime tests share."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.kernels import channel_affine, onednn


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


@pytest.fixture
def team_affine_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the row count of every MulAdd pass channel_affine ran on the OpenMP team."""
    if not channel_affine.AVAILABLE:
        pytest.skip("the team kernel needs numba and libgomp")
    rows_seen: list[int] = []
    real = channel_affine._run

    def spy(consts: np.ndarray, src: np.ndarray, stride: int, rows: int, out: np.ndarray, threads: int) -> Any:
        rows_seen.append(rows)
        return real(consts, src, stride, rows, out, threads)
    monkeypatch.setattr(channel_affine, "_run", spy)
    return rows_seen


BLOCKED_BATCH = 8  # AVX2's default threshold, which the blocked-layout tests run at on any CPU


@pytest.fixture
def blocked_from_8(monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocked regions from batch 8, as AVX2 runs them: AVX-512 keeps NHWC at every batch by
    default, and the blocked kernels must stay tested there too. Returns the threshold."""
    monkeypatch.setattr(onednn, "BLOCKED_MIN_BATCH", BLOCKED_BATCH)
    return BLOCKED_BATCH
