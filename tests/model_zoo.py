"""Test model zoo: deterministic Keras 3 / tf.Module SavedModels and their lowered packages.

Built once and cached on disk (default <repo>/.cache/models, override with KUBETRT_TEST_CACHE),
because TensorFlow export and lowering take seconds to tens of seconds per model. SavedModels are
keyed by ZOO_VERSION and the TensorFlow/Keras versions; packages additionally by a digest of the
lowering code, so a change to lowering rebuilds them. A per-model file lock lets concurrent test
sessions share the cache; every entry is written to a staged directory and renamed into place.

TensorFlow is imported only when something is actually built.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from kubetrt.runtime.package import staged_dir

ZOO_VERSION = "1"  # bump when a builder changes: cached SavedModels are rebuilt
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / ".cache" / "models"
# Lowering code whose changes make cached packages stale.
LOWERING_SOURCES = ("pipeline/ingest.py", "pipeline/lower.py", "pipeline/errors.py", "runtime/package.py")


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[Path], None]  # writes a SavedModel into the given (empty) directory
    slow: bool  # tens of seconds to build/lower: tests using it must be marked @pytest.mark.slow
    description: str


# --------------------------------------------------------------------------- builders


def _keras() -> Any:
    from kubetrt.pipeline.ingest import tensorflow

    tensorflow()  # quiet import first
    import keras

    return keras


def _randomize_batchnorm(model: Any, rng: np.random.Generator) -> None:
    """Non-trivial BN statistics, so Conv+BN folding is really exercised by every later stage."""
    keras = _keras()
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            shape = layer.moving_mean.shape
            layer.gamma.assign(rng.uniform(0.5, 1.5, shape).astype("float32"))
            layer.beta.assign(rng.normal(0.0, 0.2, shape).astype("float32"))
            layer.moving_mean.assign(rng.normal(0.0, 0.5, shape).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, shape).astype("float32"))


def _export(model: Any, path: Path) -> None:
    model.export(str(path), verbose=False)
    _keras().backend.clear_session()


def build_mlp(path: Path) -> None:
    keras = _keras()
    keras.utils.set_random_seed(1)
    x = inp = keras.Input((256,), name="features")
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dense(512, activation="relu")(x)
    out = keras.layers.Dense(10, activation="softmax")(x)
    _export(keras.Model(inp, out, name="mlp"), path)


def build_small_cnn(path: Path) -> None:
    keras = _keras()
    keras.utils.set_random_seed(2)
    L = keras.layers

    def conv_bn_relu(x: Any, filters: int, kernel: int) -> Any:
        x = L.Conv2D(filters, kernel, padding="same", use_bias=False)(x)
        return L.ReLU()(L.BatchNormalization()(x))

    inp = keras.Input((32, 32, 3), name="image")
    x = conv_bn_relu(inp, 16, 3)
    x = conv_bn_relu(x, 32, 3)
    x = L.MaxPooling2D()(x)
    x = L.DepthwiseConv2D(3, padding="same", use_bias=False)(x)
    x = L.ReLU()(L.BatchNormalization()(x))
    x = conv_bn_relu(x, 64, 1)
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(10, activation="softmax")(x)
    model = keras.Model(inp, out, name="small_cnn")
    _randomize_batchnorm(model, np.random.default_rng(2))
    _export(model, path)


def build_transformer(path: Path) -> None:
    keras = _keras()
    keras.utils.set_random_seed(3)
    L = keras.layers
    inp = keras.Input((16, 64), name="embeddings")
    attn = L.MultiHeadAttention(num_heads=4, key_dim=16)(inp, inp)
    x = L.LayerNormalization()(L.Add()([inp, attn]))
    ff = L.Dense(128, activation="gelu")(x)
    ff = L.Dense(64)(ff)
    out = L.LayerNormalization()(L.Add()([x, ff]))
    _export(keras.Model(inp, out, name="transformer"), path)


def build_mobilenet_v2(path: Path) -> None:
    keras = _keras()
    keras.utils.set_random_seed(4)
    inp = keras.Input((224, 224, 3), name="image")
    model = keras.applications.MobileNetV2(input_tensor=inp, weights=None)
    _randomize_batchnorm(model, np.random.default_rng(4))
    _export(model, path)


def build_resnet50(path: Path) -> None:
    keras = _keras()
    keras.utils.set_random_seed(5)
    inp = keras.Input((224, 224, 3), name="image")
    model = keras.applications.ResNet50(input_tensor=inp, weights=None)
    _randomize_batchnorm(model, np.random.default_rng(5))
    _export(model, path)


def build_two_in_two_out(path: Path) -> None:
    """Inputs of different dtype and rank, two named outputs of different rank (tf.Module)."""
    from kubetrt.pipeline.ingest import tensorflow

    tf = tensorflow()
    rng = np.random.default_rng(6)

    def var(*shape: int) -> Any:
        return tf.Variable(rng.normal(0.0, 0.5, shape).astype("float32"))

    class TwoInTwoOut(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table, self.w, self.b, self.v = var(16, 8), var(16, 3), var(3), var(16, 1)

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 2, 3], tf.int32)])
        def serve(self, features: Any, ids: Any) -> dict[str, Any]:
            embedded = tf.reduce_mean(tf.gather(self.table, ids), axis=[1, 2])  # ids < 16 rows
            h = tf.concat([features, embedded], axis=1)
            return {"logits": tf.matmul(h, self.w) + self.b, "score": tf.sigmoid(tf.matmul(h, self.v))[:, 0]}

    module = TwoInTwoOut()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("mlp", build_mlp, False, "Dense 256-512-512-10, relu, softmax"),
        ZooModel("small_cnn", build_small_cnn, False, "32x32x3 Conv+BN+ReLU, MaxPool, DepthwiseConv, GAP, Dense 10"),
        ZooModel("transformer", build_transformer, False, "encoder block: seq 16, d_model 64, MHA(4) + FFN(gelu), LayerNorm"),
        ZooModel("two_in_two_out", build_two_in_two_out, False, "features f32[-1,8] + ids i32[-1,2,3] -> logits, score"),
        ZooModel("mobilenet_v2", build_mobilenet_v2, True, "keras.applications.MobileNetV2, 224x224x3, random weights"),
        ZooModel("resnet50", build_resnet50, True, "keras.applications.ResNet50, 224x224x3, random weights"),
    )
}


# --------------------------------------------------------------------------- cache


def _dist_version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "none"


def lowering_digest() -> str:
    h = hashlib.sha256()
    for rel in LOWERING_SOURCES:
        h.update(rel.encode() + b"\0" + (REPO / rel).read_bytes())
    return h.hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("KUBETRT_TEST_CACHE") or DEFAULT_CACHE)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Zoo:
    """Factory for cached zoo artifacts: `zoo.savedmodel("mlp")`, `zoo.package("mlp")` (paths)."""

    def __init__(self, root: Path | None = None) -> None:
        tf_version = _dist_version("tensorflow", "tensorflow-cpu")
        keras_version = _dist_version("keras")
        self.root = (root or cache_root()) / f"zoo-v{ZOO_VERSION}-tf{tf_version}-keras{keras_version}"

    @property
    def names(self) -> list[str]:
        return list(MODELS)

    def spec(self, name: str) -> ZooModel:
        try:
            return MODELS[name]
        except KeyError:
            raise KeyError(f"no zoo model {name!r}; available: {', '.join(MODELS)}") from None

    def savedmodel(self, name: str) -> Path:
        """The model's SavedModel directory, built on first use."""
        spec = self.spec(name)
        path = self.root / name / "savedmodel"
        with _locked(self.root / name / ".lock"):
            if not path.is_dir():
                with staged_dir(path) as tmp:
                    spec.build(tmp)
        return path

    def package(self, name: str) -> Path:
        """The model's lowered package (lowered with the current lowering code), built on first use."""
        from kubetrt.pipeline.lower import lower

        savedmodel = self.savedmodel(name)
        path = self.root / name / f"package-{lowering_digest()}"
        with _locked(self.root / name / ".lock"):
            if not path.is_dir():
                lower(savedmodel, path, name=name)
                for stale in path.parent.glob("package-*"):
                    if stale != path:
                        shutil.rmtree(stale, ignore_errors=True)
        return path
