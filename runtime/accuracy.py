"""Accuracy: does an engine's output match TensorFlow's? One metric and one tolerance table.

Lowering (onnxruntime vs TensorFlow), verification of a built engine, cuda tuning and serving's
golden check at load all judge outputs here, so an engine that passed verification is held to
the same rule everywhere it is checked again.

The metric: an output passes when its shape is TensorFlow's and, elementwise,
|got - want| <= atol + rtol * |want| for floats (NaN only where TensorFlow has NaN), or
got == want exactly for every other dtype. A missing output fails.

The tolerance (atol = rtol) depends on precision and device class, because reduced precision
legitimately changes the numbers; TOLERANCES is the one table, and a verified engine records
the entry it was held to.

Elementwise bounds on random golden inputs cannot tell a usable int8 engine from a broken one, so
a package lowered with calibration data also carries held-out samples (never calibrated on) with
TensorFlow's fp32 outputs, and labels where the user gave them. HELDOUT_GATES is the table for
them, per precision: on classifier-shaped outputs ([N, classes]) the top-1 agreement with
TensorFlow, and the accuracy lost against TensorFlow's when labels are known; on every other
float output the relative RMS error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .package import HeldOut

METRIC = "elementwise |got - want| <= atol + rtol*|want|"
HOST, GPU = "host", "gpu"

TOLERANCES: dict[tuple[str, str], float] = {
    ("fp32", HOST): 1e-4,  # same arithmetic, another summation order
    ("fp32", GPU): 1e-3,  # TF32 tensor cores may run fp32 matmuls and convolutions
    ("fp16", HOST): 1e-2,
    ("fp16", GPU): 1e-2,
    # explicit Q/DQ quantization: loose on purpose; int8 accuracy belongs in a task metric,
    # this only catches broken engines
    ("int8", HOST): 1e-1,
    ("int8", GPU): 1e-1,
}


@dataclass(frozen=True)
class Tolerance:
    """The bounds one comparison used, and what they were chosen for."""

    atol: float
    rtol: float
    precision: str
    device_class: str

    def describe(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g} ({self.precision}, {self.device_class})"

    def to_json(self) -> dict[str, Any]:
        return {"metric": METRIC, "atol": self.atol, "rtol": self.rtol, "precision": self.precision,
                "device_class": self.device_class}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Tolerance":
        """A tolerance recorded by verification; ValueError if it was checked with another metric."""
        if d.get("metric") != METRIC:
            raise ValueError(f"recorded tolerance uses metric {d.get('metric')!r}; expected {METRIC!r}")
        try:
            return cls(float(d["atol"]), float(d["rtol"]), str(d["precision"]), str(d["device_class"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"recorded tolerance {dict(d)} is malformed ({e}); expected atol, rtol, "
                             "precision and device_class") from e


def device_class(device: str) -> str:
    """host for the host backend (device "host"), gpu for cuda, tensorrt and "cuda:0"-style names."""
    return HOST if device.split(":", 1)[0] == "host" else GPU


def tolerance_for(precision: str, device_cls: str) -> Tolerance:
    """The table's tolerance for outputs computed at `precision` on a `device_cls` device."""
    tol = TOLERANCES.get((precision, device_cls))
    if tol is None:
        precisions = sorted({p for p, _ in TOLERANCES})
        classes = sorted({c for _, c in TOLERANCES})
        raise ValueError(f"no tolerance for precision {precision!r} on device class {device_cls!r}; "
                         f"expected a precision in {precisions} and a device class in {classes}")
    return Tolerance(tol, tol, precision, device_cls)


@dataclass(frozen=True)
class OutputCheck:
    """One output against TensorFlow's: errors are inf when they cannot be measured."""

    name: str
    shape: tuple[int, ...]  # TensorFlow's
    max_abs_error: float
    max_rel_error: float
    passed: bool
    reason: str | None = None  # for a failure: what differs, naming the worst element

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"output": self.name, "shape": list(self.shape),
                                 "max_abs_error": _json_float(self.max_abs_error),
                                 "max_rel_error": _json_float(self.max_rel_error), "passed": self.passed}
        if self.reason is not None:
            entry["error"] = self.reason
        return entry


@dataclass(frozen=True)
class Comparison:
    """Every expected output checked at one tolerance."""

    outputs: tuple[OutputCheck, ...]
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def max_abs_error(self) -> float:
        return max((o.max_abs_error for o in self.outputs), default=0.0)

    def reason(self) -> str | None:
        """None when every output passed, else the first failure with its output's name."""
        failed = [o for o in self.outputs if not o.passed]
        if not failed:
            return None
        more = f" (and {len(failed) - 1} more outputs)" if len(failed) > 1 else ""
        return f"output {failed[0].name!r}: {failed[0].reason}{more}"


def compare(got: Mapping[str, Any], want: Mapping[str, Any], tol: Tolerance) -> Comparison:
    """Check every output of `want` (sorted by name) in `got`; extra outputs in `got` are ignored."""
    return Comparison(tuple(check_output(name, got.get(name), want[name], tol) for name in sorted(want)), tol)


def check_output(name: str, got: Any, want: Any, tol: Tolerance) -> OutputCheck:
    """One output against the expected one by the module's metric; `got` None was not produced."""
    want = np.asarray(want)
    if got is None:
        return OutputCheck(name, want.shape, math.inf, math.inf, False,
                           f"not produced (expected {want.dtype}{list(want.shape)})")
    got = np.asarray(got)
    if got.shape != want.shape:
        return OutputCheck(name, want.shape, math.inf, math.inf, False,
                           f"shape {list(got.shape)} differs from the expected {list(want.shape)}")
    exact = want.dtype.kind not in "fc"
    g, w = _comparable(got, exact), _comparable(want, exact)
    ok = (g == w) if exact else np.isclose(g, w, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    err = _abs_errors(g, w)
    max_abs = float(err.max(initial=0.0))
    max_rel = float(_rel_errors(err, w).max(initial=0.0))
    if ok.all():
        return OutputCheck(name, want.shape, max_abs, max_rel, True)
    bad = int((~ok).sum())
    worst = np.unravel_index(int(np.argmax(np.where(ok, -1.0, err))), err.shape)
    rule = f"exact match expected for {want.dtype}" if exact else f"beyond atol={tol.atol:g} + rtol={tol.rtol:g}*|expected|"
    reason = (f"{bad} of {ok.size} elements differ ({rule}), max abs error {max_abs:.3g}; worst at "
              f"{tuple(int(i) for i in worst)}: got {_show(g[worst])}, expected {_show(w[worst])}")
    return OutputCheck(name, want.shape, max_abs, max_rel, False, reason)


def _comparable(a: np.ndarray, exact: bool) -> np.ndarray:
    """Floats as float64 (or complex128), so half and single precision compare on equal terms."""
    if a.dtype.kind == "c":
        return a.astype(np.complex128)
    if exact and a.dtype.kind not in "biuf":
        return a
    return a.astype(np.float64)


def _abs_errors(g: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|g - w| with equal elements (NaN with NaN, inf with inf) at 0 and unmeasurable ones at inf."""
    if g.dtype.kind not in "biufc" or w.dtype.kind not in "biufc":
        return np.where(g == w, 0.0, math.inf)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w).astype(np.float64)
    return np.where(same, 0.0, np.where(np.isnan(err), math.inf, err))


def _rel_errors(err: np.ndarray, w: np.ndarray) -> np.ndarray:
    if w.dtype.kind not in "biufc":
        return err
    with np.errstate(invalid="ignore", over="ignore"):
        rel = err / np.maximum(np.abs(w), np.finfo(np.float64).tiny)
    return np.where(err == 0.0, 0.0, np.where(np.isnan(rel), math.inf, rel))


def _show(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, (float, np.floating)) else repr(x.item() if isinstance(x, np.generic) else x)


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------- held-out data

@dataclass(frozen=True)
class HeldOutGate:
    """What an engine of one precision must achieve on held-out data against TensorFlow fp32."""

    precision: str
    max_accuracy_drop: float  # top-1 accuracy points lost against TensorFlow's, with labels
    min_top1_agreement: float  # fraction of samples whose top-1 class is TensorFlow's
    max_relative_rmse: float  # ||got - want|| / ||want|| for outputs that are not class scores

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "max_accuracy_drop_points": self.max_accuracy_drop,
                "min_top1_agreement": self.min_top1_agreement, "max_relative_rmse": self.max_relative_rmse}


HELDOUT_GATES: dict[str, HeldOutGate] = {
    "fp32": HeldOutGate("fp32", 0.0, 0.999, 1e-3),
    "fp16": HeldOutGate("fp16", 0.5, 0.99, 1e-2),
    "int8": HeldOutGate("int8", 1.0, 0.95, 0.2),  # the usual post-training int8 budget: at most 1 point
}


# Precisions whose ranges come from calibration data. Random golden inputs fall outside the
# calibrated ranges and saturate, so for these the golden comparison is recorded but only the
# held-out gate (and the golden outputs' presence, shape and finiteness) decides.
CALIBRATED_PRECISIONS = frozenset({"int8"})


def heldout_gate(precision: str) -> HeldOutGate:
    gate = HELDOUT_GATES.get(precision)
    if gate is None:
        raise ValueError(f"no held-out gate for precision {precision!r}; expected one of {sorted(HELDOUT_GATES)}")
    return gate


def is_classifier(output: np.ndarray) -> bool:
    """Scores over classes: float [N, C] with C >= 2, the shape whose argmax is the prediction."""
    return output.dtype.kind == "f" and output.ndim == 2 and output.shape[1] >= 2


def judge_heldout(got: Mapping[str, Any], want: Mapping[str, np.ndarray], labels: np.ndarray | None,
                  gate: HeldOutGate) -> dict[str, Any]:
    """Every float output of `want` (TensorFlow fp32 on the held-out inputs) against `got`; the
    report says pass or fail per output and names the metric that failed."""
    outputs = []
    for name in sorted(want):
        w = np.asarray(want[name])
        if w.dtype.kind != "f":
            continue
        g = got.get(name)
        if g is None or np.shape(g) != w.shape:
            outputs.append({"output": name, "passed": False,
                            "error": f"got {None if g is None else list(np.shape(g))}, expected shape {list(w.shape)}"})
            continue
        outputs.append(_judge_output(name, np.asarray(g, dtype=np.float64), w.astype(np.float64), labels, gate))
    failed = [o for o in outputs if not o["passed"]]
    return {"gate": gate.to_json(), "samples": int(next(iter(want.values())).shape[0]) if want else 0,
            "labels": labels is not None, "outputs": outputs, "passed": not failed and bool(outputs),
            "summary": _heldout_summary(outputs, failed)}


def _judge_output(name: str, g: np.ndarray, w: np.ndarray, labels: np.ndarray | None, gate: HeldOutGate) -> dict[str, Any]:
    entry: dict[str, Any] = {"output": name}
    problems = []
    if not np.all(np.isfinite(g)):
        problems.append("non-finite values")
    if is_classifier(w):
        agreement = float(np.mean(g.argmax(axis=1) == w.argmax(axis=1)))
        entry["top1_agreement"] = agreement
        if agreement < gate.min_top1_agreement:
            problems.append(f"top-1 agreement {agreement:.4f} < {gate.min_top1_agreement}")
        if labels is not None and labels.shape == (w.shape[0],):
            ref = 100.0 * float(np.mean(w.argmax(axis=1) == labels))
            acc = 100.0 * float(np.mean(g.argmax(axis=1) == labels))
            entry.update(accuracy=acc, tensorflow_accuracy=ref, accuracy_drop_points=ref - acc)
            if ref - acc > gate.max_accuracy_drop:
                problems.append(f"accuracy {acc:.2f}% is {ref - acc:.2f} points below TensorFlow's {ref:.2f}% "
                                f"(at most {gate.max_accuracy_drop} allowed)")
    else:
        norm = float(np.sqrt(np.mean(w * w)))
        rmse = float(np.sqrt(np.mean((g - w) ** 2))) / max(norm, np.finfo(np.float64).tiny)
        entry["relative_rmse"] = rmse
        if not rmse <= gate.max_relative_rmse:
            problems.append(f"relative RMS error {rmse:.4g} > {gate.max_relative_rmse}")
    entry["passed"] = not problems
    if problems:
        entry["error"] = "; ".join(problems)
    return entry


def _heldout_summary(outputs: list[dict[str, Any]], failed: list[dict[str, Any]]) -> str:
    if failed:
        return f"output {failed[0]['output']!r}: {failed[0].get('error')}"
    parts = []
    for o in outputs:
        if "accuracy" in o:
            parts.append(f"{o['output']}: accuracy {o['accuracy']:.2f}% vs TensorFlow {o['tensorflow_accuracy']:.2f}%")
        elif "top1_agreement" in o:
            parts.append(f"{o['output']}: top-1 agreement {100 * o['top1_agreement']:.1f}%")
        elif "relative_rmse" in o:
            parts.append(f"{o['output']}: relative RMS error {o['relative_rmse']:.3g}")
    return ", ".join(parts) or "no float outputs to judge"


def check_heldout(predict: Callable[[dict[str, np.ndarray]], Mapping[str, Any]], heldout: HeldOut, precision: str,
                  batch: int) -> dict[str, Any]:
    """Run `predict` on the held-out samples, `batch` at a time, and judge the outputs against
    TensorFlow's by the precision's gate; an engine that fails on valid input fails the gate."""
    gate = heldout_gate(precision)
    got: dict[str, list[np.ndarray]] = {}
    try:
        for start in range(0, heldout.samples, batch):
            out = predict({k: v[start:start + batch] for k, v in heldout.inputs.items()})
            for name, value in out.items():
                got.setdefault(name, []).append(np.asarray(value))
    except Exception as e:  # noqa: BLE001 - whatever the engine raised fails it
        return {"gate": gate.to_json(), "samples": heldout.samples, "passed": False, "outputs": [],
                "summary": f"engine failed on held-out data: {type(e).__name__}: {e}"}
    return judge_heldout({k: np.concatenate(v) for k, v in got.items()}, heldout.outputs, heldout.labels, gate)
