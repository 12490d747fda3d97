"""The compiled Kubeflow pipeline: loop over targets, GPU pinning from the loop item, wiring."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kubetrt.cli import main
from kubetrt.pipeline.targets import plan_target

TARGETS = ["host", "tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64", "cuda@Tesla-T4:fp16"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("compile") / "pipeline.yaml"
    args = ["pipeline", "compile", "-o", str(out)]
    for t in TARGETS:
        args += ["--target", t]
    assert main(args) == 0
    spec, platform = yaml.safe_load_all(out.read_text())
    return spec, platform


def test_targets_parameter_and_loop(compiled) -> None:
    spec, _ = compiled
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["targets"]["defaultValue"] == [
        "host:fp32:1/8/32", "tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64", "cuda@Tesla-T4:fp16:1/8/32"]
    assert {"source", "store", "image", "name", "version", "signature", "s3_endpoint"} <= set(params)
    root = spec["root"]["dag"]["tasks"]
    loop = root["for-loop-1"]
    assert loop["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--targets"
    assert loop["inputs"]["parameters"]["pipelinechannel--targets"]["componentInputParameter"] == "targets"
    body = spec["components"]["comp-for-loop-1"]["dag"]["tasks"]
    assert set(body) == {"plan-op", "build-op", "verify-op"}  # one build (+ verify) per loop item = per target
    assert body["plan-op"]["inputs"]["parameters"]["target"]["componentInputParameter"] == "pipelinechannel--targets-loop-item"
    build_in = body["build-op"]["inputs"]
    assert build_in["parameters"]["target"]["taskOutputParameter"] == {"outputParameterKey": "spec", "producerTask": "plan-op"}
    assert build_in["artifacts"]["package"]["componentInputArtifact"] == "pipelinechannel--lower-op-package"
    assert body["verify-op"]["inputs"]["artifacts"]["engine"]["taskOutputArtifact"]["producerTask"] == "build-op"
    # ingest -> lower -> loop -> Collected -> deploy
    assert root["lower-op"]["inputs"]["artifacts"]["savedmodel"]["taskOutputArtifact"]["producerTask"] == "ingest-op"
    deploy = root["deploy-op"]["inputs"]["parameters"]["engines"]["taskOutputParameter"]
    assert deploy["producerTask"] == "for-loop-1"
    assert spec["components"]["comp-for-loop-1"]["outputDefinitions"]["parameters"][
        deploy["outputParameterKey"]]["parameterType"] == "LIST"


def test_gpu_pinning_on_build_and_verify(compiled) -> None:
    spec, platform = compiled
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name in ("exec-build-op", "exec-verify-op"):
        cfg = executors[name]
        assert cfg["nodeSelector"]["nodeSelectorJson"]["taskOutputParameter"] == {
            "outputParameterKey": "node_selector", "producerTask": "plan-op"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in cfg["tolerations"]
        container = spec["deploymentSpec"]["executors"][name]["container"]
        acc = container["resources"]["accelerator"]
        assert acc["resourceType"] == "nvidia.com/gpu"
        assert acc["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--plan-op-gpus']}}"
        assert container["image"] == "{{$.inputs.parameters['pipelinechannel--image']}}"
    assert set(executors) == {"exec-build-op", "exec-verify-op"}  # nothing else is pinned to a GPU
    # What the plan task yields per target (the values the selectors above take at run time):
    assert [plan_target(t)["node_selector"] for t in TARGETS] == [
        {}, {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, {"nvidia.com/gpu.product": "Tesla-T4"}]


def test_components_install_nothing(compiled) -> None:
    spec, _ = compiled
    for name, ex in spec["deploymentSpec"]["executors"].items():
        command = " ".join(ex["container"]["command"])
        assert "pip install" not in command, name


def test_compile_rejects_bad_target(tmp_path: Path, capsys) -> None:
    assert main(["pipeline", "compile", "-o", str(tmp_path / "p.yaml"), "--target", "tensorrt@"]) == 2
    assert "expected BACKEND" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
