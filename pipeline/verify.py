"""Verification: a built engine must reproduce TensorFlow's golden outputs before it is published,
and, where the package carries held-out data, hold its precision's task-level gate on it.

The metric and the tolerance for the target's precision and device class are the runtime's
(kubetrt.runtime.accuracy); the report records exactly what was checked, so serving can hold the
published engine to the same tolerance when it loads.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from kubetrt.pipeline.errors import PipelineError
from kubetrt.runtime.accuracy import Tolerance, check_heldout, compare, device_class, tolerance_for
from kubetrt.runtime.package import HeldOut
from kubetrt.runtime.target import Target


class VerificationError(PipelineError):
    """An engine's outputs differ from TensorFlow's beyond the precision's tolerance."""


def verify_predictions(
    predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    golden: Mapping[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
    target: Target,
) -> dict[str, Any]:
    """Run `predict` on every golden batch within the target's batch profile and build the report.

    Raises nothing on a mismatch: the report says pass or fail, and callers decide (publish or
    refuse). Raises VerificationError only when no golden batch fits the profile at all.
    """
    tol = tolerance_for(target.precision, device_class(target.backend))
    batches = sorted(b for b in golden if target.profile.min <= b <= target.profile.max)
    skipped = sorted(set(golden) - set(batches))
    if not batches:
        raise VerificationError(
            f"no golden batch size ({sorted(golden)}) is inside the target's batch profile {target.profile}; "
            "lower the model with golden batches the profile covers"
        )
    checked = [_verify_batch(predict, b, golden[b], tol) for b in batches]
    per_batch = [entry for entry, _ in checked]
    worst = max(err for _, err in checked)
    passed = all(r["passed"] for r in per_batch)
    summary = (f"{'passed' if passed else 'FAILED'}: max abs error {worst:.3g} at tolerance {tol.describe()} "
               f"over batches {batches}")
    return {
        "passed": passed,
        "tolerance": tol.to_json(),
        "batches": per_batch,
        "skipped_batches": skipped,
        "summary": summary,
    }


def _verify_batch(
    predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    batch: int,
    data: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
    tol: Tolerance,
) -> tuple[dict[str, Any], float]:
    """One golden batch's report entry and its max abs error (inf when the engine crashed)."""
    inputs, want = data
    try:
        result = compare(predict(dict(inputs)), want, tol)
    except Exception as e:  # an engine that crashes on valid input fails verification
        return {"batch": batch, "outputs": [{"output": "*", "passed": False, "error": f"{type(e).__name__}: {e}"}],
                "passed": False}, math.inf
    return {"batch": batch, "outputs": [o.to_json() for o in result.outputs], "passed": result.passed}, result.max_abs_error


def verify_heldout(
    predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    heldout: HeldOut,
    target: Target,
) -> dict[str, Any]:
    """The held-out gate of the target's precision, in batches its profile accepts."""
    return check_heldout(predict, heldout, target.precision, target.profile.max)
