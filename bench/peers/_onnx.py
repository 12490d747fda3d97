"""What the three peer adapters share: the bench's settings for one served model (one JSON in
the environment, written by bench/serving.py) and an onnxruntime session at its defaults, so that
every peer runs the same model.onnx the same way and only the serving stack differs."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import onnxruntime as ort

ENV = "KUBETRT_BENCH_PEER"


def settings() -> dict[str, Any]:
    """name, onnx, inputs/outputs ([{name, shape}] as served), ports, max_batch_size, max_queue_delay_us."""
    return json.loads(os.environ[ENV])


class Session:
    """model.onnx in onnxruntime with default options, fed and read by the served tensor names
    (the package's), which may differ from the ONNX graph's: they are matched by position."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.session = ort.InferenceSession(cfg["onnx"], providers=["CPUExecutionProvider"])
        self.feed = {t["name"]: i.name for t, i in zip(cfg["inputs"], self.session.get_inputs())}
        self.outputs = [t["name"] for t in cfg["outputs"]]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self.session.run(None, {self.feed[k]: v for k, v in inputs.items()})
        return dict(zip(self.outputs, results))
