"""The model content address follows the source and the lowering (and, once calibrated, the int8 model
and its held-out data), not TF's last-bit noise."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest

from kubetrt.pipeline.store import model_digest
from kubetrt.runtime.package import HELDOUT, MODEL_INT8_ONNX, Manifest, read_manifest


def test_relowering_noise_in_golden_keeps_the_address_and_a_new_source_changes_it(zoo) -> None:  # type: ignore[no-untyped-def]
    m = read_manifest(zoo.package("mlp"))
    noisy = dataclasses.replace(m, files={**m.files, "golden.npz": "sha256:" + "0" * 64})
    assert model_digest(noisy) == model_digest(m)
    other_source = dataclasses.replace(m, source={**m.source, "digest": "sha256:" + "1" * 64})
    assert model_digest(other_source) != model_digest(m)
    other_opset = dataclasses.replace(m, onnx={**m.onnx, "opset": 13})
    assert model_digest(other_opset) != model_digest(m)
    unsourced = dataclasses.replace(m, source={})
    assert model_digest(dataclasses.replace(unsourced, files={**m.files, "model.onnx": "sha256:" + "2" * 64})) != model_digest(unsourced)


def _digest_before_int8(manifest: Manifest) -> str:
    """model_digest as it was computed before packages could carry an int8 model (a frozen copy):
    the addresses of engines already in stores."""
    source = manifest.source.get("digest")
    tools = ("tensorflow", "tf2onnx", "onnx", "kubetrt")
    payload = {
        "inputs": [t.to_json() for t in manifest.inputs],
        "outputs": [t.to_json() for t in manifest.outputs],
        "source": source,
        "signature": manifest.signature,
        "lowering": {"opset": manifest.onnx.get("opset"), "seed": manifest.golden.get("seed"),
                     "batch_sizes": manifest.golden.get("batch_sizes"),
                     "tools": {k: manifest.provenance.get(k) for k in tools}},
    }
    if not source:
        payload = {**payload, "files": {k: v for k, v in sorted(manifest.files.items()) if not k.startswith("engines/")}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", ["mlp", "small_cnn", "two_in_two_out"])
def test_packages_without_int8_files_keep_their_address(zoo, name: str) -> None:  # type: ignore[no-untyped-def]
    m = read_manifest(zoo.package(name))
    assert MODEL_INT8_ONNX not in m.files and HELDOUT not in m.files
    assert model_digest(m) == _digest_before_int8(m)
    unsourced = dataclasses.replace(m, source={})
    assert model_digest(unsourced) == _digest_before_int8(unsourced) != model_digest(m)


def _calibrated(m: Manifest, *, int8: str = "a", heldout_file: str = "b", heldout: str = "c",
                **how: Any) -> Manifest:
    """`m` as lowering with calibration data records it (file digests and records, no real files);
    `how` overrides entries of the quantization record, `calibration` those of its data record."""
    calibration = {"source": "/data/calibration.npz", "kind": "npz", "digest": "sha256:" + "d" * 64, "samples": 64,
                   "heldout_samples": 16, "holdout": 0.2, "seed": 0, **how.pop("calibration", {})}
    quantization = {"format": "qdq", "method": "minmax", "library": {"name": "onnxruntime", "version": "1.32.0"},
                    "float": {"op_types": ["LayerNormalization", "Softmax"], "nodes": [], "requested": []},
                    "file": MODEL_INT8_ONNX, "calibration": calibration,
                    "check": {"runtime": "onnxruntime", "samples": 16, "max_abs_diff": {"output_0": 0.03}},
                    "coverage": {"host": {}}, **how}
    return dataclasses.replace(
        m,
        files={**m.files, MODEL_INT8_ONNX: "sha256:" + int8 * 64, HELDOUT: "sha256:" + heldout_file * 64},
        quantization=quantization,
        heldout={"samples": 16, "labels": False, "source": calibration["source"], "digest": "sha256:" + heldout * 64},
    )


@pytest.mark.parametrize("change", [
    {"calibration": {"digest": "sha256:" + "e" * 64}},  # other calibration data
    {"calibration": {"source": "s3://datasets/calibration.npz"}},  # the same data elsewhere: builds check the source
    {"calibration": {"holdout": 0.5}},
    {"method": "entropy"},
    {"method": "percentile", "percentile": 99.99},
    {"float": {"op_types": ["LayerNormalization", "Softmax"], "nodes": ["conv1"], "requested": ["first"]}},
    {"library": {"name": "onnxruntime", "version": "1.33.0"}},
    {"heldout": "e"},  # other held-out samples
], ids=["data", "source", "holdout", "method", "percentile", "float-layers", "onnxruntime", "heldout-samples"])
def test_how_the_int8_model_was_made_is_part_of_the_address(zoo, change: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    m = read_manifest(zoo.package("mlp"))
    calibrated = _calibrated(m)
    assert model_digest(calibrated) not in (model_digest(m), model_digest(_calibrated(m, **change)))


def test_relowering_noise_in_the_int8_files_keeps_the_address(zoo) -> None:  # type: ignore[no-untyped-def]
    """tf2onnx numbers node names per process (model.int8.onnx inherits them from model.onnx) and
    heldout.npz holds TensorFlow's outputs: neither file's bytes are stable across lowerings."""
    m = read_manifest(zoo.package("mlp"))
    calibrated = model_digest(_calibrated(m))
    assert model_digest(_calibrated(m, int8="e", heldout_file="f")) == calibrated
    noisy_outcomes = {"check": {"runtime": "onnxruntime", "samples": 16, "max_abs_diff": {"output_0": 0.031}},
                      "coverage": {"host": {"ops": {}}}}
    assert model_digest(_calibrated(m, **noisy_outcomes)) == calibrated


def test_int8_files_without_a_calibration_record_are_addressed_by_their_digests(zoo) -> None:  # type: ignore[no-untyped-def]
    m = read_manifest(zoo.package("mlp"))
    bare = dataclasses.replace(_calibrated(m), quantization={}, heldout={})
    assert model_digest(bare) != model_digest(m)
    assert model_digest(dataclasses.replace(bare, files={**bare.files, MODEL_INT8_ONNX: "sha256:" + "e" * 64})) \
        != model_digest(bare)
    assert model_digest(dataclasses.replace(bare, files={**bare.files, HELDOUT: "sha256:" + "e" * 64})) \
        != model_digest(bare)
