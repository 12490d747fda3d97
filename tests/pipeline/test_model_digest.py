"""The model content address follows the source and the lowering, not TF's last-bit noise."""
from __future__ import annotations

import dataclasses

from kubetrt.pipeline.store import model_digest
from kubetrt.runtime.package import read_manifest


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
