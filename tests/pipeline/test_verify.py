"""Verification tolerances, failing engines, and wrong-GPU builds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kubetrt.pipeline.stages import build_stage
from kubetrt.runtime.devices import NodeIdentity, resolve_target
from kubetrt.runtime.package import open_package
from kubetrt.pipeline.targets import plan_target
from kubetrt.pipeline.verify import VerificationError, verify_predictions
from kubetrt.runtime.accuracy import METRIC
from kubetrt.runtime.package import load_golden
from kubetrt.runtime.target import TargetError, parse_target


@pytest.mark.parametrize("spec,tol,device_class", [
    ("host", 1e-4, "host"),
    ("cuda@Tesla-T4:fp32", 1e-3, "gpu"),
    ("tensorrt@Tesla-T4:fp16", 1e-2, "gpu"),
    ("tensorrt@Tesla-T4:int8", 1e-1, "gpu"),
])
def test_report_records_the_tolerance_it_checked_at(spec: str, tol: float, device_class: str) -> None:
    """The target's precision and device class pick the table's tolerance; the report says which."""
    want = {"y": np.array([[1.0, 2.0]], np.float32)}
    golden = {1: ({"x": np.zeros((1, 2), np.float32)}, want)}
    within = verify_predictions(lambda feeds: {"y": want["y"] * (1 + 0.9 * tol)}, golden, parse_target(spec))
    beyond = verify_predictions(lambda feeds: {"y": want["y"] + 3 * tol}, golden, parse_target(spec))
    assert within["passed"] and not beyond["passed"]
    precision = parse_target(spec).precision
    assert within["tolerance"] == {"metric": METRIC, "atol": tol, "rtol": tol, "precision": precision,
                                   "device_class": device_class}
    assert f"atol={tol:g} rtol={tol:g} ({precision}, {device_class})" in beyond["summary"]


def test_report_entries_name_what_failed() -> None:
    want = {"y": np.array([[1.0, 2.0]], np.float32)}
    golden = {1: ({"x": np.zeros((1, 2), np.float32)}, want)}
    host = parse_target("host")

    def outputs(got):
        return verify_predictions(lambda feeds: got, golden, host)["batches"][0]["outputs"][0]

    bad = outputs({"y": want["y"] + np.array([[0, 1e-2]], np.float32)})
    assert not bad["passed"] and bad["max_abs_error"] == pytest.approx(1e-2, rel=1e-3) and "(0, 1)" in bad["error"]
    assert "shape [2, 2]" in outputs({"y": np.zeros((2, 2))})["error"]
    assert "not produced" in outputs({})["error"]
    assert not outputs({"y": np.array([[np.nan, 2.0]])})["passed"]


def test_report_fails_a_perturbed_engine(zoo) -> None:
    pkg = zoo.package("mlp")
    golden = load_golden(pkg)
    target = parse_target("host")
    good = verify_predictions(lambda feeds: golden[len(next(iter(feeds.values())))][1], golden, target)
    assert good["passed"] and good["tolerance"]["atol"] == 1e-4
    assert {b["batch"] for b in good["batches"]} == set(golden)

    def noisy(feeds):
        return {k: v + 1e-2 for k, v in golden[len(next(iter(feeds.values())))][1].items()}

    bad = verify_predictions(noisy, golden, target)
    assert not bad["passed"] and bad["summary"].startswith("FAILED")
    crash = verify_predictions(lambda feeds: 1 / 0, golden, target)
    assert not crash["passed"] and "ZeroDivisionError" in crash["batches"][0]["outputs"][0]["error"]
    with pytest.raises(VerificationError, match="batch profile 64/64/64"):
        verify_predictions(noisy, golden, parse_target("host:fp32:64/64/64"))


def test_wrong_gpu_target_fails_clearly(zoo, tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="this node has no GPU .cpu only., the target wants NVIDIA-H100-80GB-HBM3"):
        build_stage(zoo.package("mlp"), open_package(zoo.package("mlp")),
                    parse_target("tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64"), None, tmp_path / "e")
    assert not (tmp_path / "e").exists()
    target = parse_target("cuda@NVIDIA-H100-80GB-HBM3:fp16")
    with pytest.raises(TargetError, match="this node has GPU NVIDIA-A100-SXM4-80GB, the target wants NVIDIA-H100"):
        resolve_target(target, NodeIdentity("NVIDIA-A100-SXM4-80GB", "8.0", "cupy13"))
    resolved = resolve_target(target, NodeIdentity("NVIDIA-H100-80GB-HBM3", "9.0", "cupy13.6"))
    assert resolved.key() == "cuda_nvidia-h100-80gb-hbm3_sm90_cupy13.6_fp16_b1-8-32"


def test_target_plans() -> None:
    assert plan_target("host") == {"spec": "host:fp32:1/8/32", "kind": "host", "node_selector": {}}
    assert plan_target("cuda@Tesla-T4") == {"spec": "cuda@Tesla-T4:fp16:1/8/32", "kind": "gpu",
                                            "node_selector": {"nvidia.com/gpu.product": "Tesla-T4"}}
    with pytest.raises(TargetError, match="expected BACKEND"):  # the key=value form is gone
        plan_target("backend=tensorrt,gpu-product=Tesla-T4")
