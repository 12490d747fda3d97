"""Ingest: a SavedModel directory is validated cheaply, and every bad input gets a clear error."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kubetrt.pipeline.errors import IngestError
from kubetrt.pipeline.ingest import SUPPORTED_DTYPES, ingest, tensorflow
from kubetrt.runtime.package import TensorSpec, sha256_tree


@pytest.fixture(scope="module")
def odd_savedmodel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Signatures the pipeline must refuse: a string input, a string output, an unknown-rank input."""
    tf = tensorflow()

    class Odd(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def text(self, text):  # type: ignore[no-untyped-def]
            return {"length": tf.strings.length(text)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
        def to_text(self, x):  # type: ignore[no-untyped-def]
            return {"text": tf.strings.as_string(x)}

        @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
        def any_rank(self, x):  # type: ignore[no-untyped-def]
            return {"y": x * 2.0}

    path = tmp_path_factory.mktemp("odd") / "savedmodel"
    module = Odd()
    tf.saved_model.save(module, str(path), signatures={
        "serving_default": module.text, "to_text": module.to_text, "any_rank": module.any_rank,
    })
    return path


def test_two_input_model_metadata_sorted_with_dynamic_dims(zoo) -> None:
    path = zoo.savedmodel("two_in_two_out")
    info = ingest(path)
    assert info.path == path.resolve()
    assert info.signature == "serving_default"
    assert info.inputs == [TensorSpec("features", "float32", (-1, 8)), TensorSpec("ids", "int32", (-1, 2, 3))]
    assert info.outputs == [TensorSpec("logits", "float32", (-1, 3)), TensorSpec("score", "float32", (-1,))]
    assert info.digest == sha256_tree(path)
    assert "serve" in info.tags
    assert info.signatures == ("serving_default",)
    assert info.tensorflow_version == tensorflow().__version__


def test_keras_export_metadata(zoo) -> None:
    info = ingest(zoo.savedmodel("mlp"))
    assert info.inputs == [TensorSpec("features", "float32", (-1, 256))]
    assert info.outputs == [TensorSpec("output_0", "float32", (-1, 10))]
    # Keras export writes "serve" and "serving_default"; TF internals ("__saved_model_init_op") are hidden.
    assert info.signatures == ("serve", "serving_default")
    assert ingest(zoo.savedmodel("mlp"), signature="serve").inputs == info.inputs


def test_digest_tracks_content(zoo, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(zoo.savedmodel("two_in_two_out"), copy)
    before = ingest(copy).digest
    (copy / "assets").mkdir(exist_ok=True)
    (copy / "assets" / "vocab.txt").write_text("a\n")
    assert ingest(copy).digest != before


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(IngestError, match=r"nope: SavedModel directory does not exist"):
        ingest(tmp_path / "nope")


def test_file_instead_of_directory(tmp_path: Path) -> None:
    (tmp_path / "model.pb").write_bytes(b"x")
    with pytest.raises(IngestError, match=r"model\.pb: is a file; expected a SavedModel directory"):
        ingest(tmp_path / "model.pb")


def test_directory_without_saved_model_pb(tmp_path: Path) -> None:
    (tmp_path / "variables").mkdir()
    with pytest.raises(IngestError, match=rf"{tmp_path}: not a SavedModel: no saved_model\.pb"):
        ingest(tmp_path)


def test_garbage_saved_model_pb(tmp_path: Path) -> None:
    (tmp_path / "saved_model.pb").write_bytes(b"\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(IngestError, match=r"saved_model\.pb: not a SavedModel protobuf") as e:
        ingest(tmp_path)
    assert "corrupt or was not written by TensorFlow" in str(e.value)


def test_empty_saved_model_pb(tmp_path: Path) -> None:
    (tmp_path / "saved_model.pb").write_bytes(b"")  # parses as an empty message: no meta graphs
    with pytest.raises(IngestError, match=r"not a SavedModel protobuf \(no meta graphs\)"):
        ingest(tmp_path)


def test_no_serve_tag(zoo, tmp_path: Path) -> None:
    from tensorflow.core.protobuf import saved_model_pb2

    copy = tmp_path / "train_only"
    shutil.copytree(zoo.savedmodel("two_in_two_out"), copy)
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((copy / "saved_model.pb").read_bytes())
    proto.meta_graphs[0].meta_info_def.tags[:] = ["train"]
    (copy / "saved_model.pb").write_bytes(proto.SerializeToString())
    with pytest.raises(IngestError, match=r"no meta graph tagged 'serve' \(found tag sets: train\)"):
        ingest(copy)


def test_unknown_signature_lists_available(zoo) -> None:
    with pytest.raises(IngestError, match=r"signature 'predict' not found; available signatures: serve, serving_default"):
        ingest(zoo.savedmodel("mlp"), signature="predict")


def test_internal_signature_is_not_a_signature(zoo) -> None:
    with pytest.raises(IngestError, match=r"'__saved_model_init_op' not found"):
        ingest(zoo.savedmodel("mlp"), signature="__saved_model_init_op")


def test_string_input_unsupported(odd_savedmodel: Path) -> None:
    with pytest.raises(IngestError) as e:
        ingest(odd_savedmodel)
    msg = str(e.value)
    assert "signature 'serving_default' input 'text' has dtype string, which is not supported" in msg
    assert f"expected one of {', '.join(SUPPORTED_DTYPES)}" in msg
    assert str(odd_savedmodel) in msg


def test_string_output_unsupported(odd_savedmodel: Path) -> None:
    with pytest.raises(IngestError, match=r"signature 'to_text' output 'text' has dtype string"):
        ingest(odd_savedmodel, signature="to_text")


def test_unknown_rank_unsupported(odd_savedmodel: Path) -> None:
    with pytest.raises(IngestError, match=r"input 'x' has unknown rank; expected a shape with a known number"):
        ingest(odd_savedmodel, signature="any_rank")


def test_errors_are_value_errors() -> None:
    assert issubclass(IngestError, ValueError)
