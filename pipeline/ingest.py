"""Ingest: check a SavedModel directory before anything expensive touches it.

Reads only `saved_model.pb` (a protobuf parse, no graph or variable loading), so a wrong path,
tag, signature or dtype is reported in well under a second of work after TensorFlow is imported,
with a message that says what was found and what was expected.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kubetrt.pipeline.errors import IngestError
from kubetrt.runtime.package import TensorSpec, sha256_tree

logger = logging.getLogger("kubetrt.pipeline")

SAVED_MODEL_PB = "saved_model.pb"
SERVE_TAG = "serve"

# tensorflow/core/framework/types.proto enum values -> numpy dtype names. Only types that numpy,
# ONNX and the runtime all represent exactly are listed; everything else is refused at ingest.
_TF_DTYPES: dict[int, str] = {
    1: "float32",  # DT_FLOAT
    2: "float64",  # DT_DOUBLE
    3: "int32",  # DT_INT32
    4: "uint8",  # DT_UINT8
    5: "int16",  # DT_INT16
    6: "int8",  # DT_INT8
    9: "int64",  # DT_INT64
    10: "bool",  # DT_BOOL
    17: "uint16",  # DT_UINT16
    19: "float16",  # DT_HALF
    22: "uint32",  # DT_UINT32
    23: "uint64",  # DT_UINT64
}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(sorted(set(_TF_DTYPES.values())))


@dataclass(frozen=True)
class SavedModelInfo:
    """What later stages need to know about a validated SavedModel signature."""

    path: Path  # resolved SavedModel directory
    signature: str
    inputs: list[TensorSpec]  # sorted by name; -1 marks a dynamic dim
    outputs: list[TensorSpec]  # sorted by name
    digest: str  # runtime.package.sha256_tree of the whole directory
    tags: tuple[str, ...]  # tags of the meta graph that carries the signature
    signatures: tuple[str, ...]  # every user-visible signature in that meta graph, sorted
    tensorflow_version: str  # the TF version that wrote the SavedModel ("" if not recorded)


def ingest(path: str | Path, signature: str = "serving_default") -> SavedModelInfo:
    """Validate a SavedModel directory and describe `signature`, or raise IngestError saying why not."""
    root = _check_directory(Path(path))
    saved_model = _parse_saved_model(root)
    meta_graph = _serve_meta_graph(root, saved_model)
    sig = _find_signature(root, meta_graph, signature)
    inputs = _tensor_specs(root, signature, "input", sig.inputs)
    outputs = _tensor_specs(root, signature, "output", sig.outputs)
    if not outputs:
        raise IngestError(f"{root}: signature {signature!r} has no outputs; expected at least one output tensor")
    return SavedModelInfo(
        path=root,
        signature=signature,
        inputs=inputs,
        outputs=outputs,
        digest=sha256_tree(root),
        tags=tuple(meta_graph.meta_info_def.tags),
        signatures=_public_signatures(meta_graph),
        tensorflow_version=str(meta_graph.meta_info_def.tensorflow_version),
    )


def _check_directory(path: Path) -> Path:
    if not path.exists():
        raise IngestError(f"{path}: SavedModel directory does not exist")
    if not path.is_dir():
        raise IngestError(f"{path}: is a file; expected a SavedModel directory containing {SAVED_MODEL_PB}")
    if not (path / SAVED_MODEL_PB).is_file():
        hint = " (text saved_model.pbtxt is not supported)" if (path / "saved_model.pbtxt").exists() else ""
        raise IngestError(f"{path}: not a SavedModel: no {SAVED_MODEL_PB}{hint}; expected a directory "
                          "written by tf.saved_model.save or keras Model.export")
    return path.resolve()


def _parse_saved_model(root: Path) -> Any:
    tensorflow()  # quietly, before its protobuf modules pull it in noisily
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    try:
        proto.ParseFromString((root / SAVED_MODEL_PB).read_bytes())
    except (DecodeError, RuntimeWarning) as e:
        raise IngestError(f"{root / SAVED_MODEL_PB}: not a SavedModel protobuf ({e}); "
                          "the file is corrupt or was not written by TensorFlow") from e
    if not proto.meta_graphs:
        raise IngestError(f"{root / SAVED_MODEL_PB}: not a SavedModel protobuf (no meta graphs); "
                          "the file is corrupt or was not written by TensorFlow")
    return proto


def _serve_meta_graph(root: Path, saved_model: Any) -> Any:
    for meta_graph in saved_model.meta_graphs:
        if SERVE_TAG in meta_graph.meta_info_def.tags:
            return meta_graph
    found = sorted({",".join(mg.meta_info_def.tags) or "<no tags>" for mg in saved_model.meta_graphs})
    raise IngestError(f"{root}: no meta graph tagged {SERVE_TAG!r} (found tag sets: {'; '.join(found)}); "
                      "expected a SavedModel exported for serving")


def _public_signatures(meta_graph: Any) -> tuple[str, ...]:
    # "__saved_model_init_op" and friends are TF internals, not callable signatures.
    return tuple(sorted(k for k in meta_graph.signature_def if not k.startswith("__")))


def _find_signature(root: Path, meta_graph: Any, signature: str) -> Any:
    available = _public_signatures(meta_graph)
    if signature.startswith("__") or signature not in meta_graph.signature_def:
        listed = ", ".join(available) if available else "none"
        raise IngestError(f"{root}: signature {signature!r} not found; available signatures: {listed}")
    return meta_graph.signature_def[signature]


def _tensor_specs(root: Path, signature: str, kind: str, tensors: Any) -> list[TensorSpec]:
    return [_tensor_spec(root, signature, kind, name, tensors[name]) for name in sorted(tensors)]


def _tensor_spec(root: Path, signature: str, kind: str, name: str, info: Any) -> TensorSpec:
    where = f"{root}: signature {signature!r} {kind} {name!r}"
    dtype = _TF_DTYPES.get(int(info.dtype))
    if dtype is None:
        raise IngestError(f"{where} has dtype {_tf_dtype_name(int(info.dtype))}, which is not supported; "
                          f"expected one of {', '.join(SUPPORTED_DTYPES)}")
    if info.tensor_shape.unknown_rank:
        raise IngestError(f"{where} has unknown rank; expected a shape with a known number of "
                          "dimensions (use -1/None only for individual dynamic dims)")
    shape = tuple(int(d.size) if d.size >= 0 else -1 for d in info.tensor_shape.dim)
    return TensorSpec(name=name, dtype=dtype, shape=shape)


def _tf_dtype_name(enum_value: int) -> str:
    from tensorflow.core.framework import types_pb2

    try:
        return types_pb2.DataType.Name(enum_value).removeprefix("DT_").lower()
    except ValueError:
        return f"<unknown TF dtype {enum_value}>"


# --------------------------------------------------------------------------- quiet TensorFlow

# Native INFO lines ("I0000 00:00:...") and the start-up banner; warnings and errors are kept.
_NOISE = re.compile(r"^I\d{4} |absl::InitializeLog|^To enable the following instructions")


def tensorflow() -> Any:
    """Import TensorFlow with its start-up log spam silenced (unless kubetrt logs at DEBUG)."""
    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        with quiet_native_stderr():
            import tensorflow  # noqa: F401
    import tensorflow as tf

    if not logger.isEnabledFor(logging.DEBUG):
        tf.get_logger().setLevel(logging.ERROR)
        logging.getLogger("tf2onnx").setLevel(logging.ERROR)
        with contextlib.suppress(ImportError):
            import absl.logging

            absl.logging.set_verbosity(absl.logging.ERROR)
    return tf


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Capture fd 2 (where TF's C++ logs go); replay what is not known noise, all of it on failure."""
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = [ln for ln in lines if failed or not _NOISE.search(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
