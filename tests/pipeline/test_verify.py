"""Verification tolerances, failing engines, and wrong-GPU builds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kubetrt.pipeline.stages import build_stage, resolve_on_node
from kubetrt.pipeline.targets import parse_target_arg, plan_target
from kubetrt.pipeline.verify import VerificationError, compare_outputs, tolerance, verify_predictions
from kubetrt.runtime.package import load_golden
from kubetrt.runtime.target import TargetError, parse_target


def test_tolerances_by_precision_and_device() -> None:
    assert tolerance(parse_target("host")) == 1e-4
    assert tolerance(parse_target("cuda@Tesla-T4:fp32")) == 1e-3
    assert tolerance(parse_target("tensorrt@Tesla-T4:fp16")) == 1e-2
    assert tolerance(parse_target("tensorrt@Tesla-T4:int8")) == 1e-1


def test_compare_outputs_flags_errors() -> None:
    ref = {"y": np.array([[1.0, 2.0]], np.float32)}
    assert compare_outputs({"y": ref["y"] + 5e-5}, ref, 1e-4)[0]["passed"]
    bad = compare_outputs({"y": ref["y"] + 1e-2}, ref, 1e-4)[0]
    assert not bad["passed"] and bad["max_abs_error"] == pytest.approx(1e-2, rel=1e-3)
    assert "shape" in compare_outputs({"y": np.zeros((2, 2))}, ref, 1e-4)[0]["error"]
    assert "did not produce" in compare_outputs({}, ref, 1e-4)[0]["error"]
    assert not compare_outputs({"y": np.array([[np.nan, 2.0]])}, ref, 1e-4)[0]["passed"]


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
        build_stage(zoo.package("mlp"), "tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64", None, tmp_path / "e")
    assert not (tmp_path / "e").exists()
    target = parse_target("cuda@NVIDIA-H100-80GB-HBM3:fp16")
    with pytest.raises(TargetError, match="this node has GPU NVIDIA-A100-SXM4-80GB, the target wants NVIDIA-H100"):
        resolve_on_node(target, ("NVIDIA-A100-SXM4-80GB", "8.0", "cupy13"))
    resolved = resolve_on_node(target, ("NVIDIA-H100-80GB-HBM3", "9.0", "cupy13.6"))
    assert resolved.key() == "cuda_nvidia-h100-80gb-hbm3_sm90_cupy13.6_fp16_b1-8-32"


def test_target_args_and_plans() -> None:
    op = parse_target_arg("name=h100,backend=tensorrt,gpu-product=NVIDIA-H100-80GB-HBM3,precision=fp16,batch=1:8:64,max-batch=64")
    assert op == parse_target("tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64")
    assert parse_target_arg("name=cpu,backend=host,cpu,precision=fp32,batch=1:4:8") == parse_target("host:fp32:1/4/8")
    with pytest.raises(TargetError, match="bad field 'colour=red'"):
        parse_target_arg("backend=host,colour=red")
    assert plan_target("host") == {"spec": "host:fp32:1/8/32", "kind": "host", "node_selector": {}}
    assert plan_target("cuda@Tesla-T4")["node_selector"] == {"nvidia.com/gpu.product": "Tesla-T4"}
