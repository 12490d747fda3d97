"""One small Keras / tf.Module model per op family beyond plain CNNs and MLPs (transposed
convolutions, resizing, LSTM, GRU, bidirectional layers, cumulative sums, TensorFlow control
flow), lowered and run by the host runtime, against TensorFlow's own outputs at the fp32 host
tolerance of runtime/accuracy.py, on fresh inputs at several batch sizes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kubetrt.runtime import load_model
from kubetrt.runtime.accuracy import HOST, compare, tolerance_for
from kubetrt.runtime.package import read_manifest
from test_models import tf_outputs  # the TensorFlow signature, loaded once per SavedModel

FAMILIES = ["unet", "resize", "lstm", "gru", "gru_text", "bidirectional", "cumsum", "control_flow"]
FP32 = tolerance_for("fp32", HOST)


def feeds(package: Path, batch: int, seed: int, **sizes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The lowering's seeded inputs at the golden sizes of dynamic dims, or at `sizes`."""
    from kubetrt.pipeline.lower import random_inputs

    manifest = read_manifest(package)
    tails = {k: tuple(sizes.get(k, v[1:])) for k, v in manifest.golden["shapes"].items()}
    return random_inputs(manifest.inputs, tails, batch, np.random.default_rng(seed))


def check(zoo: Any, name: str, batches: tuple[int, ...], executor: str = "sequential", seed: int = 100,
          **sizes: tuple[int, ...]) -> None:
    package, savedmodel = zoo.package(name), zoo.savedmodel(name)
    model = load_model(package, executor=executor)
    for batch in batches:
        x = feeds(package, batch, seed + batch, **sizes)
        result = compare(model.predict(x), tf_outputs(savedmodel, x), FP32)
        assert result.passed, f"{name} batch {batch}: {result.reason()}"


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_tensorflow(zoo: Any, name: str) -> None:
    check(zoo, name, (1, 3, 8))


@pytest.mark.parametrize("name", ["bidirectional", "control_flow", "unet"])
def test_family_matches_tensorflow_on_dataflow_executor(zoo: Any, name: str) -> None:
    check(zoo, name, (2, 5), executor="dataflow")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_runs_on_host_kernels_only(zoo: Any, name: str) -> None:
    """Lowering recorded where every node runs: all on the host runtime, no fallback segment."""
    coverage = read_manifest(zoo.package(name)).onnx["coverage"]["host"]
    assert coverage["fallback_segments"] == [] and coverage["missing"] == []
    assert set(coverage["ops"]) == {"host"}


def test_lstm_serves_two_sequence_lengths(zoo: Any) -> None:
    """The sequence dim stays dynamic: lengths other than the golden one (10) match TensorFlow."""
    for length in (4, 23):
        check(zoo, "lstm", (1, 6), sequence=(length, 12))


def test_control_flow_runs_data_dependent_trip_counts(zoo: Any) -> None:
    """The while loop's trip count depends on the inputs: several seeds hit every count in 3..5."""
    package = zoo.package("control_flow")
    seeds = {}
    for seed in range(20):
        x = feeds(package, 4, seed + 4)
        seeds.setdefault(3 + int((x["x"][:, 0] > 0).sum()) % 3, seed)
    assert set(seeds) == {3, 4, 5}
    for seed in seeds.values():
        check(zoo, "control_flow", (4,), seed=seed)
