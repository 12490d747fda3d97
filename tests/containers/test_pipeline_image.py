"""The Kubeflow pipeline's image: the compiled pipeline names the image docker/pipeline.Dockerfile
builds, and its lower component runs in that image as Kubeflow would start it.

The component's command and args are read out of the compiled pipeline YAML; `{{$}}` becomes an
executor input with `minio://` artifact URIs, whose local paths (/minio/...) are mounted as
Kubeflow's launcher would place them, and the launcher's /tmp/kfp_outputs for the outputs. The
container has no network: whatever the component needs must already be in the image.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

from podman_pods import E2E_LABEL, TAG, image_exists, podman, say

pytestmark = pytest.mark.containers

PIPELINE_IMAGE = f"localhost/kubetrt/pipeline:{TAG}"  # scripts/e2e-images.sh: docker/pipeline.Dockerfile
DOCKERFILE = Path(__file__).resolve().parents[2] / "docker" / "pipeline.Dockerfile"
BUCKET = "/minio/mlpipeline"  # where the launcher puts minio://mlpipeline/... artifacts
OUTPUTS = "/tmp/kfp_outputs"  # the launcher's directory for output parameters and executor output
STORE = "/store"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kubetrt.pipeline.kfp_pipeline import compile_pipeline

    out = compile_pipeline(tmp_path_factory.mktemp("kfp") / "pipeline.yaml", ["host"])
    spec, _platform = yaml.safe_load_all(out.read_text())
    return dict(spec)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kubetrt-kfp-image-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_compiled_pipeline_names_the_image_built_here(compiled: dict[str, Any]) -> None:
    import kubetrt
    from kubetrt.pipeline.kfp_pipeline import DEFAULT_IMAGE

    default = compiled["root"]["inputDefinitions"]["parameters"]["image"]["defaultValue"]
    assert default == DEFAULT_IMAGE
    repository, tag = default.rsplit(":", 1)
    # Named as the other images: <registry>/kubetrt/<Dockerfile name>:<project version>.
    assert repository.endswith(f"/kubetrt/{DOCKERFILE.name.removesuffix('.Dockerfile')}"), repository
    assert tag == kubetrt.__version__
    for name, executor in compiled["deploymentSpec"]["executors"].items():
        assert executor["container"]["image"] == "{{$.inputs.parameters['pipelinechannel--image']}}", name
    assert image_exists(PIPELINE_IMAGE), f"{PIPELINE_IMAGE} is not built: run scripts/e2e-images.sh (as root)"


def _artifact(name: str, schema: str, uri: str) -> dict[str, Any]:
    return {"name": name, "type": {"schemaTitle": schema, "schemaVersion": "0.0.1"}, "uri": uri, "metadata": {}}


def _executor_input(component: dict[str, Any], parameters: dict[str, Any], inputs: dict[str, str],
                    outputs: dict[str, str]) -> dict[str, Any]:
    """The executor input Kubeflow's driver writes for `component` (its definitions in the compiled
    spec): parameter values, defaults filled in, and one artifact per URI."""
    defs = component["inputDefinitions"]
    values = {k: d["defaultValue"] for k, d in defs["parameters"].items() if "defaultValue" in d}
    values.update(parameters)
    missing = set(defs["parameters"]) - set(values)
    assert not missing, f"no value for the component's parameters {sorted(missing)}"
    in_artifacts = {k: {"artifacts": [_artifact(k, d["artifactType"]["schemaTitle"], inputs[k])]}
                    for k, d in defs.get("artifacts", {}).items()}
    out_defs = component["outputDefinitions"]
    out_artifacts = {k: {"artifacts": [_artifact(k, d["artifactType"]["schemaTitle"], outputs[k])]}
                     for k, d in out_defs.get("artifacts", {}).items()}
    out_params = {k: {"outputFile": f"{OUTPUTS}/{k}"} for k in out_defs.get("parameters", {})}
    return {"inputs": {"parameterValues": values, "artifacts": in_artifacts},
            "outputs": {"parameters": out_params, "artifacts": out_artifacts,
                        "outputFile": f"{OUTPUTS}/output_metadata.json"}}


def _run_as_compiled(executor: dict[str, Any], executor_input: dict[str, Any], mounts: dict[Path, str],
                     name: str) -> str:
    """`podman run` of the executor's container as Kubernetes runs it (command replaces the
    entrypoint, `{{$}}` substituted as the driver does); returns the log, fails with its tail."""
    container = executor["container"]
    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container["args"]]
    volumes = [arg for host, path in mounts.items() for arg in ("-v", f"{host}:{path}:rw")]
    proc = podman("run", "--name", name, "--label", E2E_LABEL, "--network", "none", *volumes,
                  "--entrypoint", json.dumps(container["command"]), PIPELINE_IMAGE, *args,
                  check=False, timeout=600)
    podman("rm", "-f", "-t", "0", name, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the lower component failed in {PIPELINE_IMAGE} ({proc.returncode}):\n{log[-4000:]}"
    return log


def test_lower_component_runs_in_the_image(compiled: dict[str, Any], work: Path) -> None:
    from kubetrt.pipeline.demo import build_example_savedmodel
    from kubetrt.pipeline.ingest import tensorflow
    from kubetrt.runtime.package import load_golden, open_package

    assert image_exists(PIPELINE_IMAGE), f"{PIPELINE_IMAGE} is not built: run scripts/e2e-images.sh (as root)"
    bucket, outputs, store = work / "bucket", work / "outputs", work / "store"
    for d in (bucket, outputs, store):
        d.mkdir()
    say("building the example Keras CNN's SavedModel (the ingest task's output artifact)")
    savedmodel = build_example_savedmodel(bucket / "ingest-op" / "savedmodel")
    executor = compiled["deploymentSpec"]["executors"][
        compiled["root"]["dag"]["tasks"]["lower-op"]["componentRef"]["name"].replace("comp-", "exec-", 1)]
    component = compiled["components"]["comp-lower-op"]
    executor_input = _executor_input(
        component,
        {"name": "", "default_name": "example-cnn", "signature": "serving_default", "version": "3",
         "store": STORE, "s3_endpoint": ""},
        inputs={"savedmodel": "minio://mlpipeline/ingest-op/savedmodel"},
        outputs={"package": "minio://mlpipeline/lower-op/package"},
    )
    say(f"running the compiled lower component in {PIPELINE_IMAGE} (podman run, no network)")
    log = _run_as_compiled(executor, executor_input, {bucket: BUCKET, outputs: OUTPUTS, store: STORE},
                           f"kubetrt-kfp-lower-{os.getpid()}")

    package = bucket / "lower-op" / "package"
    manifest = open_package(package)  # every file's digest checked
    assert (manifest.name, manifest.version) == ("example-cnn", "3")
    assert manifest.provenance.get("tensorflow"), manifest.provenance
    # What the launcher reads back: the returned digest and the package artifact's metadata.
    executor_output = json.loads((outputs / "output_metadata.json").read_text())
    digest = executor_output["parameterValues"]["Output"]
    assert (store / digest / "package" / "manifest.json").is_file(), f"package not published to the store:\n{log[-2000:]}"
    (out_artifact,) = executor_output["artifacts"]["package"]["artifacts"]
    assert out_artifact["metadata"]["model_digest"] == digest

    # The golden outputs came from TensorFlow in the image: this machine's TensorFlow agrees, and so
    # does onnxruntime on the lowered model.onnx.
    import onnxruntime

    tf = tensorflow()
    signature = tf.saved_model.load(str(savedmodel)).signatures["serving_default"]
    session = onnxruntime.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    golden = load_golden(package, manifest)
    assert golden
    for batch, (ins, outs) in golden.items():
        want = {k: v.numpy() for k, v in signature(**{n: tf.constant(x) for n, x in ins.items()}).items()}
        assert set(want) == set(outs), batch
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, ins)))
        for name, value in outs.items():
            np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-5, err_msg=f"golden {name} @ {batch}")
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"onnx {name} @ {batch}")
    say(f"lowered in the image: package {digest[:12]} in the store, golden batches {sorted(golden)}")
