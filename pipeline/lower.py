"""Lower: SavedModel signature -> model package (manifest.json, model.onnx, golden.npz).

The golden file holds TensorFlow's own outputs for seeded random inputs: it is the reference every
later stage and engine is verified against, so lowering itself refuses to finish unless
onnxruntime reproduces it from model.onnx. With calibration data the package also gets
model.int8.onnx (the Q/DQ twin, calibrated on part of the data) and heldout.npz (the rest, with
TensorFlow's outputs for it). Everything is written into a staged directory that is renamed into
place only when complete; an interrupted lowering leaves nothing behind.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import logging
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from kubetrt.telemetry.logs import log
from kubetrt.pipeline.calibration import CalibrationOptions, PreparedCalibration, check_source, prepare_calibration
from kubetrt.pipeline.errors import LowerError
from kubetrt.pipeline.ingest import SERVE_TAG, SavedModelInfo, ingest, quiet_native_stderr, tensorflow
from kubetrt.telemetry.progress import step
from kubetrt.runtime.accuracy import HOST, Tolerance, check_output, tolerance_for
from kubetrt.runtime.graph import unique_name
from kubetrt.runtime.package import (
    GOLDEN,
    HELDOUT,
    MODEL_INT8_ONNX,
    MODEL_ONNX,
    HeldOut,
    Manifest,
    TensorSpec,
    save_golden,
    save_heldout,
    sha256_file,
    staged_dir,
    write_manifest,
)

logger = logging.getLogger("kubetrt.pipeline.lower")

DEFAULT_OPSET = 17
MIN_OPSET = 13  # below 13 tf2onnx falls back to different op forms that the runtime does not target
GOLDEN_BATCH_SIZES: tuple[int, ...] = (1, 4)
FALLBACK_RUNTIMES = ("onnxruntime",)  # runtimes a lowering may accept for nodes without a kernel
# Random integer inputs are drawn from [0, INT_HIGH): valid ids/indices for any table of >= 10 rows.
INT_HIGH = 10
HELDOUT_BATCH = 32  # held-out samples per TensorFlow/onnxruntime run
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

Shapes = Mapping[str, Sequence[int]]
Batches = dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]


@dataclass(frozen=True)
class OnnxCheck:
    """How closely onnxruntime reproduced TensorFlow's golden outputs."""

    max_abs_diff: float
    worst: str  # "batch4.output_0": where max_abs_diff occurred
    tolerance: Tolerance


def lower(
    savedmodel: str | os.PathLike[str] | SavedModelInfo,
    out_dir: str | os.PathLike[str],
    name: str | None = None,
    signature: str = "serving_default",
    version: str = "1",
    seed: int = 0,
    opset: int = DEFAULT_OPSET,
    shapes: Shapes | None = None,
    allow_fallback: Sequence[str] = (),
    calibration: CalibrationOptions | None = None,
) -> Manifest:
    """Lower one SavedModel signature into a verified model package at `out_dir`.

    `shapes` gives concrete sizes for dynamic non-batch input dims (full shape, batch dim -1),
    e.g. {"tokens": (-1, 16)}; they only shape the golden inputs, the ONNX graph stays dynamic.
    A SavedModelInfo (what `ingest` returned for this signature) is lowered as it is, without
    reading and hashing the SavedModel again. `allow_fallback=("onnxruntime",)` accepts nodes the
    runtime has no kernel for, to be run by onnxruntime; otherwise such a node fails the lowering.
    `calibration` adds the INT8 model, calibrated on that data less a held-out part; the data is
    read and checked against the signature before anything slow runs.
    Raises IngestError/LowerError (ValueErrors) naming what was wrong and what was expected.
    """
    out = Path(out_dir)
    path = savedmodel.path if isinstance(savedmodel, SavedModelInfo) else savedmodel
    name = _check_name("model name", name if name is not None else default_name(path))
    version = _check_name("model version", str(version))
    if out.exists():
        raise LowerError(f"{out}: already exists; refusing to overwrite it (remove it or choose another output)")
    if calibration is not None:
        check_source(calibration)
    if isinstance(savedmodel, SavedModelInfo):
        if savedmodel.signature != signature:
            raise LowerError(f"{path}: ingested for signature {savedmodel.signature!r}, asked to lower {signature!r}")
        info = savedmodel
    else:
        with step(f"ingesting {savedmodel}"):
            info = ingest(Path(savedmodel), signature)
    tails = golden_shapes(info, shapes or {})
    prepared = None
    if calibration is not None:
        with step(f"reading calibration data {calibration.source}"):
            prepared = prepare_calibration(calibration, info.inputs, seed)
    check_opset(opset)
    unknown = sorted(set(allow_fallback) - set(FALLBACK_RUNTIMES))
    if unknown:
        raise LowerError(f"fallback runtime(s) {unknown}: expected any of {list(FALLBACK_RUNTIMES)}")
    try:
        with staged_dir(out) as tmp:
            manifest = _lower_into(tmp, info, tails, name=name, version=version, seed=seed, opset=opset,
                                   allow_fallback=tuple(allow_fallback), calibration=prepared)
    except FileExistsError as e:  # created by someone else while we were working
        raise LowerError(f"{out}: already exists; refusing to overwrite it ({e})") from e
    log(logger, logging.INFO, "lowered", savedmodel=str(info.path), package=str(out), name=name,
        version=version, opset=opset, max_abs_diff=manifest.onnx["check"]["max_abs_diff"])
    return manifest


def default_name(savedmodel: str | os.PathLike[str]) -> str:
    """The SavedModel directory's name; for TF Serving layouts (`<model>/<version>/`) the model's."""
    path = Path(savedmodel).resolve()
    return path.parent.name if path.name.isdigit() and path.parent.name else path.name


def golden_shapes(info: SavedModelInfo, shapes: Shapes) -> dict[str, tuple[int, ...]]:
    """Per input, the dims after the batch dim to use for golden inputs; refuse what cannot be drawn."""
    known = {t.name for t in info.inputs}
    unknown = sorted(set(shapes) - known)
    if unknown:
        raise LowerError(f"shape override for unknown input(s) {', '.join(unknown)}; "
                         f"signature {info.signature!r} inputs are: {', '.join(sorted(known)) or 'none'}")
    return {t.name: _golden_tail(info, t, shapes.get(t.name)) for t in info.inputs}


def _golden_tail(info: SavedModelInfo, spec: TensorSpec, override: Sequence[int] | None) -> tuple[int, ...]:
    where = f"{info.path}: signature {info.signature!r} input {spec.name!r} (shape {list(spec.shape)})"
    if not spec.shape or spec.shape[0] != -1:
        raise LowerError(f"{where}: expected a dynamic leading batch dim (-1) so golden data can be "
                         f"recorded at batch sizes {list(GOLDEN_BATCH_SIZES)}")
    if override is None:
        dynamic = [i for i, d in enumerate(spec.shape) if d < 0 and i > 0]
        if dynamic:
            example = ",".join(["-1"] + [str(d if d > 0 else 8) for d in spec.shape[1:]])
            raise LowerError(f"{where}: dims {dynamic} are dynamic, so golden inputs need concrete sizes; "
                             f"pass a shape override, e.g. --shape {spec.name}={example}")
        return tuple(spec.shape[1:])
    return _check_override(where, spec, tuple(int(d) for d in override))


def _check_override(where: str, spec: TensorSpec, override: tuple[int, ...]) -> tuple[int, ...]:
    expected = f"expected {len(spec.shape)} dims, -1 for the batch dim, the model's size for static dims"
    if len(override) != len(spec.shape) or override[0] != -1:
        raise LowerError(f"{where}: shape override {list(override)} does not fit; {expected}")
    for i, (want, got) in enumerate(zip(spec.shape[1:], override[1:]), start=1):
        if got <= 0 or (want >= 0 and want != got):
            raise LowerError(f"{where}: shape override {list(override)} has {got} at dim {i}; {expected}")
    return override[1:]


def check_opset(opset: int) -> None:
    """Refuse an opset tf2onnx cannot emit before spending time on the conversion."""
    tensorflow()  # tf2onnx imports TensorFlow: keep it quiet
    from tf2onnx import constants

    highest = max(constants.OPSET_TO_IR_VERSION)
    if not MIN_OPSET <= opset <= highest:
        raise LowerError(f"ONNX opset {opset} is not supported; expected {MIN_OPSET}..{highest} "
                         f"(tf2onnx {_version('tf2onnx')}; default {DEFAULT_OPSET})")


def _check_name(what: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise LowerError(f"{what} {value!r}: expected 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit (it becomes part of URLs and resource names)")
    return value


def _lower_into(tmp: Path, info: SavedModelInfo, tails: dict[str, tuple[int, ...]], *, name: str,
                version: str, seed: int, opset: int, allow_fallback: tuple[str, ...],
                calibration: PreparedCalibration | None = None) -> Manifest:
    tf = tensorflow()
    with step("loading SavedModel"):
        loaded = tf.saved_model.load(str(info.path), tags=[SERVE_TAG])  # keeps fn's variables alive
        fn = loaded.signatures[info.signature]
    with step("recording TensorFlow golden outputs"):
        batches = record_golden(fn, info, tails, seed)
        save_golden(tmp / GOLDEN, batches)
    with step(f"converting to ONNX (opset {opset})"):
        model = convert(fn, info, opset)
        label_batch_dims(model, batches)
    with step("checking ONNX (onnx.checker, onnxruntime vs golden)"):
        check_model(model, info)
        (tmp / MODEL_ONNX).write_bytes(model.SerializeToString())
        result = check_onnxruntime(tmp / MODEL_ONNX, batches)
    with step("checking kubetrt's kernels cover every node"):
        coverage = check_coverage(model, name, allow_fallback)
    manifest = _manifest(tmp, info, model, result, tails, name=name, version=version, seed=seed, opset=opset)
    manifest.onnx["coverage"] = coverage
    if calibration is not None:
        _add_int8(tmp, manifest, fn, info, model, calibration, allow_fallback)
    write_manifest(tmp, manifest)
    return manifest


def _add_int8(tmp: Path, manifest: Manifest, fn: Any, info: SavedModelInfo, model: Any,
              calibration: PreparedCalibration, allow_fallback: tuple[str, ...]) -> None:
    """Write model.int8.onnx and heldout.npz into `tmp` and record both in `manifest`."""
    from kubetrt.pipeline.quantize import quantization_record, quantize

    held = calibration.heldout
    with step(f"recording TensorFlow outputs for {held.samples} held-out samples"):
        outputs = run_batched(fn, info, held.inputs, HELDOUT_BATCH)
        save_heldout(tmp / HELDOUT, HeldOut(held.inputs, outputs, held.labels))
    options = calibration.options
    method = options.method + (f" {options.percentile_value}" if options.percentile_value is not None else "")
    with step(f"calibrating on {calibration.calibrate.samples} samples with {method}"):
        quantized = quantize(model, calibration.calibrate.inputs, options)
        (tmp / MODEL_INT8_ONNX).write_bytes(quantized.model.SerializeToString())
    with step("checking the INT8 model (onnxruntime on the held-out samples)"):
        check = check_int8_onnxruntime(tmp / MODEL_INT8_ONNX, held.inputs, outputs)
    with step("checking kubetrt's kernels cover every INT8 node"):
        coverage = check_coverage(quantized.model, f"{manifest.name} ({MODEL_INT8_ONNX})", allow_fallback)
    manifest.quantization = {**quantization_record(quantized, calibration), "check": check, "coverage": coverage}
    manifest.heldout = calibration.heldout_record()
    manifest.files[MODEL_INT8_ONNX] = sha256_file(tmp / MODEL_INT8_ONNX)
    manifest.files[HELDOUT] = sha256_file(tmp / HELDOUT)


def _manifest(tmp: Path, info: SavedModelInfo, model: Any, check: OnnxCheck, tails: dict[str, tuple[int, ...]],
              *, name: str, version: str, seed: int, opset: int) -> Manifest:
    return Manifest(
        name=name,
        version=version,
        signature=info.signature,
        inputs=_manifest_specs(model.graph.input, info.inputs),
        outputs=_manifest_specs(model.graph.output, info.outputs),
        files={MODEL_ONNX: sha256_file(tmp / MODEL_ONNX), GOLDEN: sha256_file(tmp / GOLDEN)},
        source={"uri": info.path.as_uri(), "digest": info.digest, "tags": list(info.tags)},
        provenance=provenance(info),
        onnx={"opset": opset, "ir_version": int(model.ir_version), "converter": "tf2onnx",
              "check": {"runtime": "onnxruntime", "atol": check.tolerance.atol, "rtol": check.tolerance.rtol,
                        "max_abs_diff": check.max_abs_diff, "worst": check.worst}},
        golden={"batch_sizes": list(GOLDEN_BATCH_SIZES), "seed": seed,
                "shapes": {k: [-1, *v] for k, v in sorted(tails.items())}},
    )


# --------------------------------------------------------------------------- golden data


def random_inputs(specs: Sequence[TensorSpec], tails: Mapping[str, tuple[int, ...]], batch: int,
                  rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Seeded inputs: normal floats, small non-negative ints (valid as ids/indices), fair bools."""
    return {t.name: _random_array(np.dtype(t.dtype), (batch, *tails[t.name]), rng) for t in specs}


def _random_array(dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, INT_HIGH, size=shape).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    raise LowerError(f"cannot draw random golden inputs of dtype {dtype}")


def record_golden(fn: Any, info: SavedModelInfo, tails: Mapping[str, tuple[int, ...]], seed: int) -> Batches:
    """Run the TF signature on seeded inputs at each golden batch size: the reference outputs."""
    rng = np.random.default_rng(seed)
    batches: Batches = {}
    for batch in GOLDEN_BATCH_SIZES:
        inputs = random_inputs(info.inputs, tails, batch, rng)
        batches[batch] = (inputs, run_signature(fn, info, inputs, "random inputs"))
    return batches


def run_signature(fn: Any, info: SavedModelInfo, inputs: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """TensorFlow's outputs for one batch of `inputs`, checked against the SignatureDef."""
    tf = tensorflow()
    batch = int(next(iter(inputs.values())).shape[0])
    try:
        raw = fn(**{k: tf.constant(v) for k, v in inputs.items()})
    except Exception as e:  # TF raises many unrelated types for bad shapes/values
        raise LowerError(f"{info.path}: TensorFlow failed to run signature {info.signature!r} on "
                         f"{what} at batch {batch} ({type(e).__name__}: {e})") from e
    outputs = {k: np.asarray(v.numpy()) for k, v in raw.items()}
    _check_tf_outputs(info, batch, outputs)
    return outputs


def run_batched(fn: Any, info: SavedModelInfo, inputs: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """TensorFlow's outputs for N samples, run `batch` at a time and concatenated."""
    n = int(next(iter(inputs.values())).shape[0])
    parts: list[dict[str, np.ndarray]] = []
    for start in range(0, n, batch):
        chunk = {k: v[start:start + batch] for k, v in inputs.items()}
        outputs = run_signature(fn, info, chunk, "held-out calibration samples")
        size = int(next(iter(chunk.values())).shape[0])
        for key, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != size:
                raise LowerError(f"{info.path}: output {key!r} is {list(value.shape)} for {size} samples; held-out "
                                 "outputs are recorded per sample, so every output needs the batch as its first dim")
        parts.append(outputs)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _check_tf_outputs(info: SavedModelInfo, batch: int, outputs: Mapping[str, np.ndarray]) -> None:
    expected = {t.name: t for t in info.outputs}
    if set(outputs) != set(expected):
        raise LowerError(f"{info.path}: signature {info.signature!r} returned outputs {sorted(outputs)}, "
                         f"but its SignatureDef declares {sorted(expected)}")
    for key, value in outputs.items():
        spec = expected[key]
        fits = len(value.shape) == len(spec.shape) and all(d < 0 or d == g for d, g in zip(spec.shape, value.shape))
        if str(value.dtype) != spec.dtype or not fits:
            raise LowerError(f"{info.path}: output {key!r} at batch {batch} is {value.dtype}{list(value.shape)}; "
                             f"the signature declares {spec.dtype}{list(spec.shape)}")


# --------------------------------------------------------------------------- conversion


def convert(fn: Any, info: SavedModelInfo, opset: int) -> Any:
    """tf2onnx on a frozen positional wrapper of the signature; graph I/O renamed to the signature's names.

    The wrapper fixes the order of inputs and outputs, so renaming does not depend on how tf2onnx
    names placeholders (`x:0`, `args_0`, ...). Freezing turns everything the function captures
    into constants: variables, and also captured tensors that are not variables (EfficientNet's
    normalization statistics, ConvNeXt's layer scales), which tf2onnx's function path would
    otherwise leave as extra graph inputs.
    """
    tf = tensorflow()
    import tf2onnx

    names_in = [t.name for t in info.inputs]
    names_out = [t.name for t in info.outputs]
    specs = [tf.TensorSpec([None if d < 0 else d for d in t.shape], tf.as_dtype(t.dtype), name=f"kubetrt_in{i}")
             for i, t in enumerate(info.inputs)]

    @tf.function(input_signature=specs, autograph=False)
    def positional(*args: Any) -> list[Any]:
        outputs = fn(**dict(zip(names_in, args)))
        return [outputs[k] for k in names_out]

    try:
        with quiet_native_stderr():
            frozen = freeze(positional.get_concrete_function())
            graph_in = [t.name for t in frozen.inputs]
            graph_out = [t.name for t in frozen.outputs]
            if len(graph_in) != len(names_in):
                raise LowerError(f"{info.path}: the frozen signature {info.signature!r} still has inputs "
                                 f"{graph_in}; expected only the signature's {names_in}")
            model, _ = tf2onnx.convert.from_graph_def(inlinable(frozen.graph.as_graph_def()), input_names=graph_in,
                                                      output_names=graph_out, opset=opset,
                                                      custom_op_handlers=CUSTOM_OP_HANDLERS)
    except LowerError:
        raise
    except Exception as e:  # tf2onnx raises bare Exceptions/ValueErrors/KeyErrors for unsupported graphs
        raise LowerError(f"{info.path}: tf2onnx could not convert signature {info.signature!r} at opset "
                         f"{opset} ({type(e).__name__}: {e})") from e
    rename = dict(zip(graph_in, names_in)) | dict(zip(graph_out, names_out))
    rename_io(model, rename, names_in, names_out)
    return model


def freeze(concrete: Any) -> Any:
    """The concrete function with every capture (variables and captured tensors) as a constant.

    Control flow stays as While/If (not lowered to Switch/Merge), which tf2onnx turns into ONNX
    Loop/If.
    """
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    return convert_variables_to_constants_v2(concrete, lower_control_flow=False, aggressive_inlining=True)


XLA_MARKERS = ("_XlaMustCompile", "_noinline")


def inlinable(graph_def: Any) -> Any:
    """`graph_def` with its function calls free to be inlined.

    Keras 3 runs grouped convolutions (ConvNeXt's depthwise ones) in functions marked for XLA
    compilation; TensorFlow's inliner keeps those as calls, which tf2onnx cannot convert. Without
    the marker, the inliner tf2onnx runs (grappler's function optimizer) replaces them by their body.
    """
    for fn in graph_def.library.function:
        for key in XLA_MARKERS:
            if key in fn.attr:
                del fn.attr[key]
    for node in [*graph_def.node, *(n for fn in graph_def.library.function for n in fn.node_def)]:
        for key in XLA_MARKERS:
            if key in node.attr:
                del node.attr[key]
    return graph_def


def _erfc(ctx: Any, node: Any, name: str, args: Any) -> None:
    """erfc(x) = 1 - erf(x). Keras 3's exact gelu emits Erfc, which tf2onnx 1.17 cannot convert."""
    from tf2onnx import utils

    dtype = ctx.get_dtype(node.output[0])
    one = ctx.make_const(utils.make_name(f"{name}_one"), np.array(1, dtype=utils.map_onnx_to_numpy_type(dtype)))
    erf = ctx.make_node("Erf", [node.input[0]], op_name_scope=name,
                        shapes=[ctx.get_shape(node.output[0])], dtypes=[dtype])
    node.type = "Sub"
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


# TF ops tf2onnx lacks: {tf op: (handler(ctx, node, name, args), args)} (tf2onnx's custom-op API).
CUSTOM_OP_HANDLERS: dict[str, tuple[Any, list[Any]]] = {"Erfc": (_erfc, [])}


def rename_io(model: Any, rename: Mapping[str, str], names_in: Sequence[str], names_out: Sequence[str]) -> None:
    """Give the ONNX graph the signature's input/output names, in signature (sorted) order."""
    graph = model.graph
    mapping = {g.name: rename[g.name] for g in [*graph.input, *graph.output] if g.name in rename}
    got_in = [mapping.get(g.name, g.name) for g in graph.input]
    got_out = [mapping.get(g.name, g.name) for g in graph.output]
    if sorted(got_in) != sorted(names_in) or sorted(got_out) != sorted(names_out):
        raise LowerError(f"tf2onnx produced graph inputs {[g.name for g in graph.input]} and outputs "
                         f"{[g.name for g in graph.output]}; cannot map them onto the signature's "
                         f"inputs {list(names_in)} and outputs {list(names_out)}")
    taken = _all_names(graph) - set(mapping)
    for new in set(mapping.values()) & taken:  # an internal tensor already uses a signature name
        mapping[new] = unique_name(new, taken | set(mapping.values()))
    _rename_graph(graph, mapping)
    _reorder(graph.input, names_in)
    _reorder(graph.output, names_out)


def _subgraphs(graph: Any) -> Iterator[Any]:
    from onnx import AttributeProto

    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield attr.g
            elif attr.type == AttributeProto.GRAPHS:
                yield from attr.graphs


def _all_names(graph: Any) -> set[str]:
    names = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
    names |= {t.name for t in graph.initializer}
    for node in graph.node:
        names |= set(node.input) | set(node.output)
    for sub in _subgraphs(graph):
        names |= _all_names(sub)
    return names - {""}


def _rename_graph(graph: Any, mapping: Mapping[str, str]) -> None:
    for v in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
        v.name = mapping.get(v.name, v.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
    for sub in _subgraphs(graph):  # subgraphs may refer to outer-scope tensors by name
        _rename_graph(sub, mapping)


def _reorder(values: Any, order: Sequence[str]) -> None:
    by_name = {v.name: v for v in values}
    copies = [type(by_name[n])() for n in order]
    for copy, n in zip(copies, order):
        copy.CopyFrom(by_name[n])
    del values[:]
    values.extend(copies)


def label_batch_dims(model: Any, batches: Batches) -> None:
    """Name the leading dim `batch` on inputs, and on outputs whose leading dim followed the batch."""
    for value in model.graph.input:
        _set_dim_param(value, "batch")
    for value in model.graph.output:
        if all(outs[value.name].ndim and outs[value.name].shape[0] == b for b, (_, outs) in batches.items()):
            _set_dim_param(value, "batch")


def _set_dim_param(value: Any, param: str) -> None:
    dims = value.type.tensor_type.shape.dim
    if len(dims) and not dims[0].HasField("dim_value"):
        dims[0].dim_param = param


# --------------------------------------------------------------------------- checks


def check_model(model: Any, info: SavedModelInfo) -> None:
    """onnx.checker with full shape inference: a structurally broken graph fails here, not in a build."""
    import onnx

    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise LowerError(f"{info.path}: the ONNX graph tf2onnx produced is invalid ({e})") from e


def _onnxruntime_session(model_path: Path, what: str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types, not exported uniformly
        raise LowerError(f"onnxruntime cannot load the {what} graph ({type(e).__name__}: {e})") from e


def check_onnxruntime(model_path: Path, batches: Batches) -> OnnxCheck:
    """Run model.onnx under onnxruntime on the golden inputs; refuse if it disagrees with TensorFlow."""
    session = _onnxruntime_session(model_path, "lowered")
    # onnxruntime computes on the host at TensorFlow's own precision
    tol = tolerance_for("fp32", HOST)
    worst = OnnxCheck(0.0, "", tol)
    for batch, (inputs, expected) in batches.items():
        names = list(expected)
        try:
            got = dict(zip(names, session.run(names, inputs)))
        except Exception as e:
            raise LowerError(f"onnxruntime failed to run the lowered graph at batch {batch} "
                             f"({type(e).__name__}: {e})") from e
        for key in names:
            diff = check_faithful(f"batch{batch}.{key}", got[key], expected[key], tol)
            if diff >= worst.max_abs_diff:
                worst = OnnxCheck(diff, f"batch{batch}.{key}", tol)
    return worst


def check_int8_onnxruntime(model_path: Path, inputs: Mapping[str, np.ndarray],
                           expected: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Run the Q/DQ model under onnxruntime on the held-out inputs: it must load and run, and how far
    it lands from TensorFlow is recorded (judging it is the accuracy gate's job, not lowering's)."""
    session = _onnxruntime_session(model_path, "quantized")
    names = list(expected)
    n = int(next(iter(inputs.values())).shape[0])
    got: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for start in range(0, n, HELDOUT_BATCH):
        chunk = {k: v[start:start + HELDOUT_BATCH] for k, v in inputs.items()}
        try:
            for key, value in zip(names, session.run(names, chunk)):
                got[key].append(value)
        except Exception as e:
            raise LowerError(f"onnxruntime failed to run the quantized graph on held-out samples "
                             f"{start}..{start + len(next(iter(chunk.values()))) - 1} ({type(e).__name__}: {e})") from e
    diffs = {}
    for key in names:
        value = np.concatenate(got[key])
        if value.shape != expected[key].shape or value.dtype != expected[key].dtype:
            raise LowerError(f"onnxruntime's quantized output {key} is {value.dtype}{list(value.shape)}; TensorFlow "
                             f"gave {expected[key].dtype}{list(expected[key].shape)}")
        diffs[key] = float(np.max(np.abs(value.astype(np.float64) - expected[key].astype(np.float64)), initial=0.0))
    return {"runtime": "onnxruntime", "samples": n, "max_abs_diff": diffs}


def check_coverage(model: Any, name: str, allow_fallback: tuple[str, ...]) -> dict[str, Any]:
    """Where each node will run, per kernel device; LowerError naming the model, node and op where
    nothing permitted can run a node, or where the host runtime refuses to compile one.

    The host runtime compiles the whole graph here, so a kernel that rejects an attribute fails
    the lowering, not a pod's first request.
    """
    from kubetrt.runtime.coverage import KERNEL_DEVICES, place, require_runnable
    from kubetrt.runtime.devices import get_device
    from kubetrt.runtime.onnx_import import from_proto

    graph = from_proto(model)
    try:
        report = {"host": require_runnable(graph, "host", name, allow_fallback).to_json()}
        get_device("host").prepare(from_proto(model), {})
    except Exception as e:  # a kernel factory's refusal, or its bug: either way lowering must not pass
        raise LowerError(f"model {name}: kubetrt cannot run the lowered graph ({type(e).__name__}: {e})") from e
    for device in KERNEL_DEVICES:
        if device not in report:
            report[device] = place(graph, device, allow_fallback).to_json()
    return report


def check_faithful(where: str, got: np.ndarray, want: np.ndarray, tol: Tolerance) -> float:
    """Max abs difference of onnxruntime vs TensorFlow; LowerError unless dtypes match and the
    values are within `tol`."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise LowerError(f"onnxruntime output {where} is {got.dtype}{list(got.shape)}; "
                         f"TensorFlow gave {want.dtype}{list(want.shape)}")
    result = check_output(where, got, want, tol)
    if not result.passed:
        raise LowerError(f"onnxruntime output {where} differs from TensorFlow: {result.reason}; "
                         "the conversion is not faithful")
    return result.max_abs_error


def _manifest_specs(values: Any, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """Signature names and shapes with the dtype ONNX actually carries (checked against TF's)."""
    from onnx import helper

    by_name = {v.name: v for v in values}
    result = []
    for spec in specs:
        dtype = str(np.dtype(helper.tensor_dtype_to_np_dtype(by_name[spec.name].type.tensor_type.elem_type)))
        if dtype != spec.dtype:
            raise LowerError(f"ONNX graph tensor {spec.name!r} has dtype {dtype}; the signature declares {spec.dtype}")
        result.append(TensorSpec(spec.name, dtype, spec.shape))
    return result


def provenance(info: SavedModelInfo) -> dict[str, Any]:
    """Tool versions and time: enough to tell which toolchain produced a package."""
    import onnx
    import onnxruntime
    import tf2onnx

    return {
        "tensorflow": tensorflow().__version__,
        "tf2onnx": tf2onnx.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "kubetrt": _version("kubetrt"),
        "python": platform.python_version(),
        "savedmodel_tensorflow": info.tensorflow_version,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
