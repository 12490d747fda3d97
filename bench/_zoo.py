"""Benchmarks reuse the test model zoo (same seeded Keras models, same on-disk cache)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def zoo():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "tests"))
    from model_zoo import Zoo

    return Zoo()
