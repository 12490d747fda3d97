"""Verification: a built engine must reproduce TensorFlow's golden outputs before it is published.

The tolerance depends on precision and device, because reduced precision legitimately changes
the numbers:
  fp32 on the host   1e-4  (same arithmetic, different summation order)
  fp32 on a GPU      1e-3  (TF32 tensor cores may be used for fp32 matmul/conv)
  fp16               1e-2
  int8               1e-1  (explicit Q/DQ quantization; stated loosely on purpose: int8 accuracy
                            belongs in a task metric, this only catches broken engines)
An element passes when |engine - tf| <= tol + tol * |tf| (numpy.allclose with atol = rtol = tol).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from kubetrt.pipeline.errors import PipelineError
from kubetrt.runtime.target import Target

TOLERANCES: dict[tuple[str, str], float] = {
    ("fp32", "host"): 1e-4,
    ("fp32", "gpu"): 1e-3,
    ("fp16", "host"): 1e-2,
    ("fp16", "gpu"): 1e-2,
    ("int8", "host"): 1e-1,
    ("int8", "gpu"): 1e-1,
}


class VerificationError(PipelineError):
    """An engine's outputs differ from TensorFlow's beyond the precision's tolerance."""


def tolerance(target: Target) -> float:
    """The atol = rtol used to compare this target's outputs with TensorFlow's."""
    return TOLERANCES[(target.precision, "gpu" if target.is_gpu else "host")]


def compare_outputs(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tol: float) -> list[dict[str, Any]]:
    """Per-output errors and verdicts; a missing output, shape mismatch or NaN is a failure."""
    results: list[dict[str, Any]] = []
    for name, ref in sorted(want.items()):
        entry: dict[str, Any] = {"output": name, "shape": list(np.shape(ref))}
        out = got.get(name)
        if out is None:
            results.append(dict(entry, passed=False, error=f"engine did not produce output {name!r}"))
            continue
        out = np.asarray(out)
        if out.shape != np.shape(ref):
            results.append(dict(entry, passed=False, error=f"shape {list(out.shape)}, expected {list(np.shape(ref))}"))
            continue
        a = out.astype(np.float64)
        b = np.asarray(ref).astype(np.float64)
        diff = np.abs(a - b)
        max_abs = float(diff.max()) if diff.size else 0.0
        rel = diff / np.maximum(np.abs(b), np.finfo(np.float64).tiny)
        max_rel = float(rel.max()) if rel.size else 0.0
        finite = bool(np.isfinite(a).all() == np.isfinite(b).all() and np.array_equal(np.isnan(a), np.isnan(b)))
        ok = finite and bool(np.allclose(a, b, atol=tol, rtol=tol, equal_nan=True))
        entry.update(max_abs_error=max_abs, max_rel_error=_json_float(max_rel), passed=ok)
        if not finite:
            entry["error"] = "non-finite values differ from TensorFlow's"
        results.append(entry)
    return results


def verify_predictions(
    predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    golden: Mapping[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
    target: Target,
) -> dict[str, Any]:
    """Run `predict` on every golden batch within the target's batch profile and build the report.

    Raises nothing on a mismatch: the report says pass or fail, and callers decide (publish or
    refuse). Raises VerificationError only when no golden batch fits the profile at all.
    """
    tol = tolerance(target)
    batches = sorted(b for b in golden if target.profile.min <= b <= target.profile.max)
    skipped = sorted(set(golden) - set(batches))
    if not batches:
        raise VerificationError(
            f"no golden batch size ({sorted(golden)}) is inside the target's batch profile {target.profile}; "
            "lower the model with golden batches the profile covers"
        )
    per_batch: list[dict[str, Any]] = []
    for b in batches:
        inputs, want = golden[b]
        try:
            got = predict(dict(inputs))
            outputs = compare_outputs(got, want, tol)
        except Exception as e:  # an engine that crashes on valid input fails verification
            outputs = [{"output": "*", "passed": False, "error": f"{type(e).__name__}: {e}"}]
        per_batch.append({"batch": b, "outputs": outputs, "passed": all(o["passed"] for o in outputs)})
    passed = all(r["passed"] for r in per_batch)
    worst = max((o.get("max_abs_error", math.inf) for r in per_batch for o in r["outputs"]), default=0.0)
    summary = (
        f"{'passed' if passed else 'FAILED'}: max abs error {worst:.3g} at tolerance {tol:g} "
        f"({target.precision}, {'gpu' if target.is_gpu else 'host'}) over batches {batches}"
    )
    return {
        "passed": passed,
        "tolerance": {"atol": tol, "rtol": tol, "precision": target.precision},
        "batches": per_batch,
        "skipped_batches": skipped,
        "summary": summary,
    }


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None
