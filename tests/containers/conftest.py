"""Fixtures of the end-to-end test with real images (tests/containers, `pytest -m containers`).

scripts/e2e-containers.sh builds the images and runs these tests (the default pytest run deselects
them); selected without podman or the images, they fail and say how to get them.
"""
from __future__ import annotations

import copy
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from podman_pods import IMAGE_UID, images_missing, say


@pytest.fixture(scope="session", autouse=True)
def images() -> None:
    problem = images_missing()
    if problem:
        pytest.fail(f"{problem}: run scripts/e2e-containers.sh (as root)", pytrace=False)


@dataclass
class PipelineModel:
    """The example CNN through the in-process pipeline into a local store, and TensorFlow's answers."""

    root: Path  # world-traversable: containers (uid 65532) read hostPaths under it
    savedmodel: Path
    package_dir: Path  # the lowered package (no engines)
    store: Path
    digest: str
    key: str  # the host engine the pipeline built (removed from the store again)
    deployment: dict[str, Any]  # the ModelDeployment the pipeline's deploy step wrote
    inputs: dict[str, np.ndarray]
    tensorflow: dict[str, np.ndarray]  # TensorFlow's outputs for `inputs`
    engines: list[dict[str, Any]]  # the pipeline's engine records (JSON), as its deploy step read them

    def model_deployment(self) -> dict[str, Any]:
        return copy.deepcopy(self.deployment)


def _give_to_image_user(path: Path) -> None:
    """The build Job (uid 65532) publishes into the store: as a PVC with fsGroup would allow."""
    for p in [path, *path.rglob("*")]:
        if os.geteuid() == 0:
            os.chown(p, IMAGE_UID, IMAGE_UID, follow_symlinks=False)
        elif not p.is_symlink():
            p.chmod(p.stat().st_mode | stat.S_IRWXO)


@pytest.fixture(scope="module")
def model() -> Iterator[PipelineModel]:
    from kubetrt.pipeline.demo import build_example_savedmodel
    from kubetrt.pipeline.ingest import tensorflow
    from kubetrt.pipeline.stages import run_pipeline
    from kubetrt.runtime.package import open_package

    root = Path(tempfile.mkdtemp(prefix="kubetrt-e2e-"))
    root.chmod(0o755)
    try:
        say("lowering the example Keras CNN and running the pipeline in process (target host)")
        savedmodel = build_example_savedmodel(root / "example-cnn")
        result = run_pipeline(str(savedmodel), str(root / "store"), ["host"], root / "work")
        (engine,) = result.engines
        manifest = open_package(result.package_dir)
        rng = np.random.default_rng(7)
        inputs = {}
        for t in manifest.inputs:
            shape = [4 if d in (-1, None) else int(d) for d in t.shape]
            inputs[t.name] = rng.standard_normal(shape).astype(t.dtype)
        tf = tensorflow()
        serving_default = tf.saved_model.load(str(savedmodel)).signatures["serving_default"]
        want = {k: v.numpy() for k, v in serving_default(**{n: tf.constant(x) for n, x in inputs.items()}).items()}
        m = PipelineModel(root, savedmodel, result.package_dir, root / "store", result.model_digest, engine.key,
                          result.deployment, inputs, want, [e.to_json() for e in result.engines])
        # Take the engine out of the store (with any staging leftovers): the EngineBuild Job must build it.
        shutil.rmtree(m.store / m.digest / m.key)
        for leftover in (m.store / m.digest).glob(f".{m.key}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        _give_to_image_user(m.store)
        for p in [root, *root.rglob("*")]:  # readable by the containers' user
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
        say(f"pipeline done: model digest {m.digest[:12]}, engine {m.key} removed from the store")
        yield m
    finally:
        shutil.rmtree(root, ignore_errors=True)
