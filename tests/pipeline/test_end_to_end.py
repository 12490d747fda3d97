"""End to end: one kfp.local run plus its rerun (reuse), the in-process path, the CLI and the demo."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from kubetrt.cli import main
from kubetrt.pipeline.store import LocalStore


def _engine_state(store_root: Path) -> dict[str, tuple[int, int, str]]:
    """(inode, mtime_ns, content) of every published report: a rebuild or republish changes them."""
    return {
        str(p.relative_to(store_root)): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_text())
        for p in store_root.glob("*/*/report.json")
    }


def _validate(resource: dict) -> None:
    from kubetrt.operators.crds import model_deployment_spec_schema

    assert resource["apiVersion"] == "kubetrt.io/v1alpha1" and resource["kind"] == "ModelDeployment"
    jsonschema.validate(resource["spec"], model_deployment_spec_schema())


@pytest.fixture(scope="module")
def kfp_runs(model_zoo, tmp_path_factory: pytest.TempPathFactory):
    from kubetrt.pipeline.kfp_pipeline import run_local

    tmp = tmp_path_factory.mktemp("kfp")
    source = str(model_zoo.savedmodel("small_cnn"))
    store = tmp / "store"
    first = run_local(source, str(store), ["host"], tmp / "root1", name="small_cnn")
    state = _engine_state(store)
    second = run_local(f"file://{source}", str(store), ["host"], tmp / "root2", name="small_cnn")
    return tmp, store, yaml.safe_load(first), state, yaml.safe_load(second)


def test_kfp_local_run_publishes_verified_engine(kfp_runs) -> None:
    _, store_root, deployment, state, _ = kfp_runs
    _validate(deployment)
    digest = deployment["metadata"]["annotations"]["kubetrt.io/model-digest"]
    engines = json.loads(deployment["metadata"]["annotations"]["kubetrt.io/verified-engines"])
    assert list(engines) == ["cpu"] and engines["cpu"].startswith("host_cpu_")
    store = LocalStore(store_root)
    assert store.has_package(digest) and store.list_engines(digest) == [engines["cpu"]]
    report = store.read_report(digest, engines["cpu"])
    assert report["passed"] and report["tolerance"]["atol"] == 1e-4
    assert all(o["max_abs_error"] <= 1e-4 for b in report["batches"] for o in b["outputs"])
    assert deployment["spec"]["model"]["source"]["uri"] == f"file://{store_root}/{digest}/package"
    assert len(state) == 1


def test_kfp_rerun_reuses_engine(kfp_runs) -> None:
    tmp, store_root, first, state, second = kfp_runs
    assert yaml.safe_dump(second) == yaml.safe_dump(first)
    assert _engine_state(store_root) == state  # same report file, untouched: nothing rebuilt or republished
    reused = list((tmp / "root2").rglob("build-op/engine/REUSED"))
    assert len(reused) == 1 and not list((tmp / "root1").rglob("build-op/engine/REUSED"))


def test_in_process_pipeline_cli(zoo, tmp_path: Path, capsys) -> None:
    out = tmp_path / "md.yaml"
    args = ["pipeline", "run", str(zoo.savedmodel("mlp")), "--store", str(tmp_path / "store"),
            "--target", "host", "--target", "host:fp32:1/4/4", "--no-kfp", "--name", "mlp", "-o", str(out)]
    assert main(args) == 0
    resource = yaml.safe_load(out.read_text())
    _validate(resource)
    assert [t["name"] for t in resource["spec"]["targets"]] == ["cpu", "cpu-fp32"]
    keys = json.loads(resource["metadata"]["annotations"]["kubetrt.io/verified-engines"])
    assert len(set(keys.values())) == 2
    assert main(args) == 0  # rerun: reuses both engines
    assert yaml.safe_load(capsys.readouterr().out.split("---")[0]) is not None


@pytest.mark.parametrize("args, message", [
    (["pipeline", "run", "/no/such/model", "--no-kfp"], "model not found"),
    (["pipeline", "run", "ftp://h/m", "--no-kfp"], "unsupported URI scheme 'ftp'"),
    (["pipeline", "run", "/x", "--no-kfp", "--target", "cuda"], "needs a GPU product"),
    (["build", "--package", "/no/such/pkg", "--target", "host"], "model package not found"),
])
def test_cli_bad_inputs(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    assert main([*args, "--store", str(tmp_path / "store")]) == 2
    assert message in capsys.readouterr().err


def test_demo_serves_real_requests(tmp_path: Path) -> None:
    from kubetrt.pipeline.demo import _report, run_demo

    lines: list[str] = []
    result = run_demo(tmp_path, use_kfp=False, requests=5, say=lines.append)
    assert result.served_by == "http", result.notes
    assert len(result.latencies_ms) == 5 and result.max_abs_error < 1e-4
    assert result.verification.startswith("passed")
    assert any(line.startswith("prediction[0]: class") for line in lines)
    _validate(yaml.safe_load((tmp_path / "modeldeployment.yaml").read_text()))
    assert any(line.startswith("deployment:") and str(tmp_path / "modeldeployment.yaml") in line for line in lines)
    # run in a directory the CLI removes afterwards, the report names no file there but --workdir
    removed: list[str] = []
    _report(result, None, removed.append)
    (line,) = [line for line in removed if line.startswith("deployment:")]
    assert str(tmp_path) not in line and "--workdir DIR" in line
