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
    shapes: dict[str, tuple[int, ...]] | None = None  # golden sizes for dynamic non-batch dims (lower's `shapes`)


# --------------------------------------------------------------------------- builders


def _keras() -> Any:
    from kubetrt.pipeline.ingest import tensorflow

    tensorflow()  # quiet import first
    import keras

    return keras


def randomize_batchnorm(model: Any, rng: np.random.Generator, spread: float = 1.0) -> None:
    """Non-trivial BN statistics, so Conv+BN folding is really exercised by every later stage.

    `spread` scales how far they stray from identity: very deep random networks (EfficientNetV2-M)
    become chaotic at the full spread, where no two runtimes can agree."""
    keras = _keras()
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            shape = layer.moving_mean.shape
            if layer.gamma is not None:  # scale=False layers (Inception's) have none
                layer.gamma.assign(rng.uniform(1.0 - 0.5 * spread, 1.0 + 0.5 * spread, shape).astype("float32"))
            if layer.beta is not None:
                layer.beta.assign(rng.normal(0.0, 0.2 * spread, shape).astype("float32"))
            layer.moving_mean.assign(rng.normal(0.0, 0.5 * spread, shape).astype("float32"))
            layer.moving_variance.assign(rng.uniform(1.0 - 0.5 * spread, 1.0 + spread, shape).astype("float32"))


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
    randomize_batchnorm(model, np.random.default_rng(2))
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


def _application(path: Path, name: str, seed: int) -> None:
    """A keras.applications model at 224x224 with random weights and spread batch-norm statistics."""
    keras = _keras()
    keras.utils.set_random_seed(seed)
    inp = keras.Input((224, 224, 3), name="image")
    model = getattr(keras.applications, name)(input_tensor=inp, weights=None)
    randomize_batchnorm(model, np.random.default_rng(seed))
    _export(model, path)


def build_mobilenet_v2(path: Path) -> None:
    _application(path, "MobileNetV2", 4)


def build_resnet50(path: Path) -> None:
    _application(path, "ResNet50", 5)


def build_efficientnet_b0(path: Path) -> None:
    _application(path, "EfficientNetB0", 13)


def build_densenet121(path: Path) -> None:
    _application(path, "DenseNet121", 14)


def build_bn_cnn(path: Path) -> None:
    """A plain VGG-style CNN (conv, batch norm, relu, max-pool) of the kind users write themselves."""
    keras = _keras()
    keras.utils.set_random_seed(15)
    L = keras.layers
    x = inp = keras.Input((64, 64, 3), name="image")
    for filters in (32, 64, 128):
        x = L.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = L.ReLU()(L.BatchNormalization()(x))
        x = L.MaxPooling2D()(x)
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(10, activation="softmax")(L.Dense(64, activation="relu")(x))
    model = keras.Model(inp, out, name="bn_cnn")
    randomize_batchnorm(model, np.random.default_rng(15))
    _export(model, path)


def build_gru_text(path: Path) -> None:
    """A text classifier: token ids -> Embedding 64 -> GRU 128 -> Dense 2 (sentiment-style)."""
    keras = _keras()
    keras.utils.set_random_seed(16)
    L = keras.layers
    inp = keras.Input((64,), dtype="int32", name="tokens")
    x = L.Embedding(1000, 64)(inp)
    x = L.GRU(128)(x)
    _export(keras.Model(inp, L.Dense(2, activation="softmax")(x), name="gru_text"), path)


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


# --------------------------------------------------------------------------- op families
# One small model per op family tf2onnx emits beyond plain CNNs and MLPs: transposed
# convolutions, resizing, recurrent layers, cumulative sums and TensorFlow control flow.


def build_unet(path: Path) -> None:
    """Encoder-decoder with Conv2DTranspose (stride 2, 'same' and 'valid'), a skip connection,
    UpSampling2D (nearest and bilinear) and a Conv1DTranspose head on the flattened rows."""
    keras = _keras()
    keras.utils.set_random_seed(7)
    L = keras.layers
    inp = keras.Input((32, 32, 3), name="image")
    e1 = L.Conv2D(8, 3, padding="same", activation="relu")(inp)
    e2 = L.Conv2D(16, 3, strides=2, padding="same", activation="relu")(e1)
    e3 = L.Conv2D(16, 3, strides=2, padding="same", activation="relu")(e2)
    d2 = L.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu")(e3)
    d2 = L.Concatenate()([d2, e2])
    d1 = L.Conv2DTranspose(8, 2, strides=2, padding="valid")(d2)
    up = L.UpSampling2D(2, interpolation="nearest")(e2)
    bi = L.UpSampling2D(2, interpolation="bilinear")(e2)
    x = L.Concatenate()([d1, e1, L.Conv2D(8, 1)(up), L.Conv2D(8, 1)(bi)])
    out = L.Conv2D(2, 1, name="mask")(x)
    _export(keras.Model(inp, out, name="unet"), path)


def build_resize(path: Path) -> None:
    """tf.image.resize bilinear and nearest, up and down ('bicubic' and 'area' are left out:
    tf2onnx's conversions of them do not reproduce TensorFlow at the fp32 tolerance, and lowering
    refuses them)."""
    keras = _keras()
    keras.utils.set_random_seed(8)
    L = keras.layers
    inp = keras.Input((12, 16, 3), name="image")
    outs = [L.Flatten()(L.Resizing(h, w, interpolation=m)(inp))
            for m, (h, w) in (("bilinear", (24, 20)), ("nearest", (18, 40)), ("bilinear", (6, 7)),
                              ("nearest", (5, 9)))]
    _export(keras.Model(inp, L.Concatenate()(outs), name="resize"), path)


def build_lstm(path: Path) -> None:
    """Stacked LSTMs over a sequence whose length is dynamic (served at two lengths)."""
    keras = _keras()
    keras.utils.set_random_seed(9)
    L = keras.layers
    inp = keras.Input((None, 12), name="sequence")
    x = L.LSTM(24, return_sequences=True)(inp)
    x = L.LSTM(16)(x)
    _export(keras.Model(inp, L.Dense(4)(x), name="lstm"), path)


def build_gru(path: Path) -> None:
    keras = _keras()
    keras.utils.set_random_seed(10)
    L = keras.layers
    inp = keras.Input((20, 12), name="sequence")
    x = L.GRU(24, return_sequences=True)(inp)
    x = L.GRU(16, reset_after=False)(x)
    _export(keras.Model(inp, L.Dense(4)(x), name="gru"), path)


def build_bidirectional(path: Path) -> None:
    """Token ids -> Embedding -> Bidirectional LSTM (sequences) -> Bidirectional GRU -> SimpleRNN-free head."""
    keras = _keras()
    keras.utils.set_random_seed(11)
    L = keras.layers
    inp = keras.Input((16,), dtype="int32", name="tokens")
    x = L.Embedding(10, 8)(inp)  # golden ids are drawn from [0, 10)
    x = L.Bidirectional(L.LSTM(12, return_sequences=True))(x)
    x = L.Bidirectional(L.GRU(8))(x)
    _export(keras.Model(inp, L.Dense(3)(x), name="bidirectional"), path)


def build_cumsum(path: Path) -> None:
    """tf.math.cumsum in its four exclusive x reverse forms, on two axes."""
    from kubetrt.pipeline.ingest import tensorflow

    tf = tensorflow()

    class CumSum(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 6, 5], tf.float32)])
        def serve(self, x: Any) -> dict[str, Any]:
            return {"plain": tf.math.cumsum(x, axis=1),
                    "exclusive": tf.math.cumsum(x, axis=2, exclusive=True),
                    "reverse": tf.math.cumsum(x, axis=1, reverse=True),
                    "both": tf.math.cumsum(x, axis=-1, exclusive=True, reverse=True)}

    module = CumSum()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def build_control_flow(path: Path) -> None:
    """A tf.Module with a data-dependent while loop carrying tensors and a tf.cond per sample batch."""
    from kubetrt.pipeline.ingest import tensorflow

    tf = tensorflow()
    rng = np.random.default_rng(12)

    class ControlFlow(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(rng.normal(0.0, 0.3, (8, 8)).astype("float32"))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def serve(self, x: Any) -> dict[str, Any]:
            def body(i: Any, h: Any, acc: Any) -> Any:
                h = tf.tanh(tf.matmul(h, self.w) + x)
                return i + 1, h, acc + tf.reduce_sum(h, axis=1)

            steps = 3 + tf.cast(tf.reduce_sum(tf.cast(x[:, 0] > 0, tf.int32)) % 3, tf.int32)
            _, h, acc = tf.while_loop(lambda i, h, acc: i < steps, body,
                                      [tf.constant(0), tf.zeros_like(x), tf.zeros_like(x[:, 0])])
            gated = tf.cond(tf.reduce_mean(h) > 0, lambda: h * 2.0, lambda: h - 1.0)
            return {"state": gated, "total": acc}

    module = ControlFlow()
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
        ZooModel("efficientnet_b0", build_efficientnet_b0, True, "keras.applications.EfficientNetB0, 224x224x3, random weights"),
        ZooModel("densenet121", build_densenet121, True, "keras.applications.DenseNet121, 224x224x3, random weights"),
        ZooModel("bn_cnn", build_bn_cnn, False, "64x64x3 (Conv 3x3 + BN + ReLU + MaxPool) x3, GAP, Dense 64, Dense 10"),
        ZooModel("gru_text", build_gru_text, False, "tokens i32[-1,64] -> Embedding 64 -> GRU 128 -> Dense 2 softmax"),
        ZooModel("unet", build_unet, False, "32x32x3 encoder-decoder: Conv2DTranspose, skip concat, UpSampling2D nearest+bilinear"),
        ZooModel("resize", build_resize, False, "12x16x3 -> Resizing bilinear/nearest, up and down"),
        ZooModel("lstm", build_lstm, False, "sequence f32[-1,-1,12] -> LSTM 24 (sequences) -> LSTM 16 -> Dense 4",
                 shapes={"sequence": (-1, 10, 12)}),
        ZooModel("gru", build_gru, False, "sequence f32[-1,20,12] -> GRU 24 (reset_after) -> GRU 16 (reset_before) -> Dense 4"),
        ZooModel("bidirectional", build_bidirectional, False, "tokens i32[-1,16] -> Embedding -> BiLSTM 12 -> BiGRU 8 -> Dense 3"),
        ZooModel("cumsum", build_cumsum, False, "tf.math.cumsum exclusive/reverse on f32[-1,6,5]"),
        ZooModel("control_flow", build_control_flow, False, "tf.Module: data-dependent tf.while_loop + tf.cond on f32[-1,8]"),
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

        spec = self.spec(name)
        savedmodel = self.savedmodel(name)
        path = self.root / name / f"package-{lowering_digest()}"
        with _locked(self.root / name / ".lock"):
            if not path.is_dir():
                lower(savedmodel, path, name=name, shapes=spec.shapes)
                for stale in path.parent.glob("package-*"):
                    if stale != path:
                        shutil.rmtree(stale, ignore_errors=True)
        return path
