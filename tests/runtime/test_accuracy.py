"""The one accuracy rule: metric edges, the tolerance table, and recorded tolerances."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.accuracy import METRIC, Tolerance, check_output, compare, device_class, tolerance_for

HOST_FP32 = tolerance_for("fp32", "host")


def test_table_by_precision_and_device_class() -> None:
    assert tolerance_for("fp32", "host") == Tolerance(1e-4, 1e-4, "fp32", "host")
    assert tolerance_for("fp32", "gpu").atol == 1e-3
    assert tolerance_for("fp16", "host").rtol == tolerance_for("fp16", "gpu").rtol == 1e-2
    assert tolerance_for("int8", "gpu").atol == 1e-1
    assert [device_class(d) for d in ("host", "cuda", "cuda:0", "tensorrt")] == ["host", "gpu", "gpu", "gpu"]


@pytest.mark.parametrize("precision,cls", [("bf16", "host"), ("fp32", "tpu")])
def test_unknown_precision_or_device_class_is_named(precision: str, cls: str) -> None:
    with pytest.raises(ValueError, match=rf"no tolerance for precision '{precision}' on device class '{cls}'; "
                                         r"expected a precision in \['fp16', 'fp32', 'int8'\]"):
        tolerance_for(precision, cls)


def test_tolerance_boundary_passes_and_just_beyond_fails() -> None:
    want = np.array([0.0, 1.0])
    bound = np.array([1e-4, 2e-4])  # atol + rtol * |want|
    assert check_output("y", want + bound * 0.999, want, HOST_FP32).passed
    assert check_output("y", np.array([1e-4, 1.0]), want, HOST_FP32).passed  # exactly atol at 0: inclusive
    beyond = check_output("y", np.array([np.nextafter(1e-4, 1.0), 1.0]), want, HOST_FP32)
    assert not beyond.passed and "1 of 2 elements" in beyond.reason and "worst at (0,)" in beyond.reason
    assert not check_output("y", want + bound * 1.01, want, HOST_FP32).passed
    assert check_output("y", want + bound * 1.01, want, tolerance_for("fp32", "gpu")).passed


def test_nan_only_where_the_reference_has_nan() -> None:
    want = np.array([[np.nan, 1.0], [np.inf, -2.0]], np.float32)
    same = check_output("y", want.copy(), want, HOST_FP32)
    assert same.passed and same.max_abs_error == 0.0
    extra_nan = check_output("y", np.array([[np.nan, np.nan], [np.inf, -2.0]], np.float32), want, HOST_FP32)
    assert not extra_nan.passed and "worst at (0, 1): got nan, expected 1" in extra_nan.reason
    missing_nan = check_output("y", np.array([[0.0, 1.0], [np.inf, -2.0]], np.float32), want, HOST_FP32)
    assert not missing_nan.passed and "worst at (0, 0)" in missing_nan.reason
    assert not check_output("y", np.array([[np.nan, 1.0], [-np.inf, -2.0]], np.float32), want, HOST_FP32).passed


def test_non_float_outputs_must_match_exactly() -> None:
    want = np.array([1000, 7], np.int64)
    loose = tolerance_for("int8", "gpu")  # 1001 would be within 1e-1 + 1e-1*1000 as floats
    off = check_output("ids", np.array([1001, 7], np.int64), want, loose)
    assert not off.passed and off.max_abs_error == 1.0
    assert "exact match expected for int64" in off.reason and "got 1001, expected 1000" in off.reason
    assert check_output("ids", want.copy(), want, loose).passed
    flags = np.array([True, False])
    assert not check_output("mask", np.array([True, True]), flags, loose).passed


def test_shape_mismatch_and_missing_output_fail() -> None:
    want = {"y": np.zeros((2, 3), np.float32), "z": np.zeros(2, np.float32)}
    result = compare({"y": np.zeros((3, 2), np.float32), "extra": np.ones(1)}, want, HOST_FP32)
    assert not result.passed and [o.name for o in result.outputs] == ["y", "z"]
    y, z = result.outputs
    assert not y.passed and "shape [3, 2] differs from the expected [2, 3]" in y.reason
    assert not z.passed and z.reason == "not produced (expected float32[2])"
    assert y.to_json()["max_abs_error"] is None  # unmeasurable, and still valid JSON
    assert result.reason() == "output 'y': shape [3, 2] differs from the expected [2, 3] (and 1 more outputs)"
    assert result.max_abs_error == float("inf")


def test_half_precision_output_against_float32_reference() -> None:
    want = np.array([1.0, 3.0], np.float32)
    got = want.astype(np.float16) + np.float16(2e-3)
    assert compare({"y": got}, {"y": want}, tolerance_for("fp16", "gpu")).passed
    assert compare({"y": got}, {"y": want}, HOST_FP32).reason().startswith("output 'y': 2 of 2 elements differ")


def test_recorded_tolerance_round_trips_and_refuses_another_metric() -> None:
    tol = tolerance_for("fp16", "gpu")
    assert tol.to_json()["metric"] == METRIC
    assert Tolerance.from_json(tol.to_json()) == tol
    with pytest.raises(ValueError, match="uses metric 'max relative error'; expected"):
        Tolerance.from_json(dict(tol.to_json(), metric="max relative error"))
    with pytest.raises(ValueError, match="is malformed"):
        Tolerance.from_json({"metric": METRIC, "atol": 1e-2})
