"""Post-training static quantization: a float ONNX model -> its explicit Q/DQ twin (int8).

The form is the one TensorRT consumes for explicit quantization (and the host runtime folds into
int8 kernels): QuantizeLinear/DequantizeLinear pairs, int8 with zero point 0 (symmetric),
weights per output channel, activations per tensor, biases left in float (TensorRT and NVIDIA's
own quantization tools keep them float; an int32 bias adds nothing they use). onnxruntime's
calibrators measure the activation ranges and its quantizer does the graph surgery.

The ranges are measured here, batch by batch, and handed to quantize_static as per-tensor range
overrides, rather than left to quantize_static's own pass: that pass builds entropy histograms
with as many bins as int8 has levels, which leaves the KL search a single candidate (entropy
would equal minmax), and it keeps every batch's activations in memory before histogramming. Here
entropy and percentile use 2048-bin histograms (as TensorRT's calibrators do) and memory holds one
batch's activations. Entropy is the slow method: onnxruntime's KL search takes about half a
second per calibrated tensor.

Softmax and LayerNormalization stay in float by default: their outputs are probabilities and
normalized values whose useful range int8 flattens, and TensorRT runs them in float anyway.
Quantization is a pure function of the float model, the calibration arrays and the options.
"""
from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from kubetrt.pipeline.calibration import CalibrationError, CalibrationOptions, PreparedCalibration
from kubetrt.pipeline.errors import LowerError
from kubetrt.runtime.package import MODEL_INT8_ONNX
from kubetrt.telemetry.logs import log

logger = logging.getLogger("kubetrt.pipeline.quantize")

FLOAT_OP_TYPES = ("Softmax", "LayerNormalization")  # never quantized (see the module doc)
WEIGHTED_OP_TYPES = ("Conv", "MatMul", "Gemm")  # the layers "first" and "last" name
KEYWORDS = ("first", "last")
CALIBRATION_BATCH = 16  # samples per calibration run; ranges are merged batch by batch
METHOD_NAMES = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}  # onnxruntime's enum
HISTOGRAM_BINS = 2048  # entropy/percentile histogram resolution (TensorRT's calibrators use 2048)
QUANTIZED_BINS = 128  # int8's levels on one side of zero: what the entropy search quantizes into


@dataclass(frozen=True)
class Quantized:
    """The Q/DQ model and what was done to make it (Manifest.quantization, less the data)."""

    model: Any  # onnx.ModelProto
    record: dict[str, Any]


def quantize(model: Any, calibration: Mapping[str, np.ndarray], options: CalibrationOptions) -> Quantized:
    """Quantize the float `model` with activation ranges measured on `calibration` (N samples per input).

    onnxruntime's pre-processing runs first (shape inference and the graph optimizations that fold
    BatchNorm/Mul/Add into convolutions, so the folded weights are what is quantized); `keep_float`
    names resolve against that graph. Raises CalibrationError for options that do not fit the
    model, LowerError when onnxruntime cannot quantize it.
    """
    import onnx
    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    with tempfile.TemporaryDirectory(prefix="kubetrt-quantize-") as tmp, _quiet_onnxruntime():
        work = Path(tmp)
        float_path, pre_path, out_path = work / "float.onnx", work / "pre.onnx", work / MODEL_INT8_ONNX
        onnx.save(model, str(float_path))
        symbolic = pre_process(float_path, pre_path)
        pre = onnx.load(str(pre_path))
        nodes, op_types = resolve_keep_float(model, pre, options.keep_float)
        quantize_types = sorted(set(_quantizable_op_types()) - set(FLOAT_OP_TYPES) - set(op_types))
        ranges = measure_ranges(pre_path, work / "augmented.onnx", calibration, quantize_types, options)
        extra: dict[str, Any] = {
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "QuantizeBias": False,
            "TensorQuantOverrides": {name: [{"rmin": lo, "rmax": hi}] for name, (lo, hi) in ranges.items()},
        }
        # quantize_static insists on calibrating: one sample, as every range it measures (the same
        # tensors, chosen by the same op types) is replaced by the override from `ranges`
        one = {k: v[:1] for k, v in calibration.items()}
        try:
            quantize_static(
                str(pre_path), str(out_path), BatchReader(one, 1),
                quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8, op_types_to_quantize=quantize_types, nodes_to_exclude=list(nodes),
                calibrate_method=CalibrationMethod.MinMax, extra_options=extra,
            )
        except Exception as e:  # onnxruntime raises bare Exceptions/ValueErrors/its own Fail types
            raise LowerError(f"onnxruntime could not quantize the model ({type(e).__name__}: {e})") from e
        quantized = onnx.load(str(out_path))
    counts = {op: sum(n.op_type == op for n in quantized.graph.node) for op in ("QuantizeLinear", "DequantizeLinear")}
    if not counts["QuantizeLinear"]:
        raise CalibrationError("quantization left the model without a single QuantizeLinear: nothing it holds is "
                               f"quantizable with op types {quantize_types} and float nodes {sorted(nodes)}")
    record = {
        "format": "qdq",
        "weights": {"type": "int8", "symmetric": True, "granularity": "per-channel"},
        "activations": {"type": "int8", "symmetric": True, "granularity": "per-tensor"},
        "bias": "float",
        "method": options.method,
        **({"percentile": options.percentile_value} if options.percentile_value is not None else {}),
        "library": {"name": "onnxruntime", "version": onnxruntime.__version__},
        "pre_process": {"symbolic_shape_inference": symbolic},
        "float": {"op_types": sorted({*FLOAT_OP_TYPES, *op_types}), "nodes": sorted(nodes),
                  "requested": list(options.keep_float)},
        "nodes": counts,
        "file": MODEL_INT8_ONNX,
    }
    log(logger, logging.INFO, "quantized", method=options.method, samples=_samples(calibration), **counts)
    return Quantized(quantized, record)


def quantization_record(quantized: Quantized, prepared: PreparedCalibration) -> dict[str, Any]:
    """Manifest.quantization: how the int8 model was made, and from which data."""
    return {**quantized.record, "calibration": prepared.record()}


def measure_ranges(model_path: Path, augmented_path: Path, calibration: Mapping[str, np.ndarray],
                   op_types: Sequence[str], options: CalibrationOptions) -> dict[str, tuple[np.float32, np.float32]]:
    """{tensor: (rmin, rmax)} for every activation the quantizer may quantize, measured with
    `options.method` a batch at a time (the quantizer then centres each range on zero)."""
    from onnxruntime.quantization import CalibrationMethod, create_calibrator

    extra: dict[str, Any] = {"symmetric": True, "num_bins": HISTOGRAM_BINS, "num_quantized_bins": QUANTIZED_BINS}
    if options.percentile_value is not None:
        extra["percentile"] = options.percentile_value
    try:
        calibrator = create_calibrator(model_path, list(op_types), augmented_model_path=str(augmented_path),
                                       calibrate_method=getattr(CalibrationMethod, METHOD_NAMES[options.method]),
                                       extra_options=extra)
        reader = BatchReader(calibration, CALIBRATION_BATCH)
        if options.method == "entropy":
            measured = entropy_ranges(calibrator, reader)
        else:
            for i in range(len(reader)):
                reader.set_range(i, i + 1)
                calibrator.collect_data(reader)
            measured = {name: tuple(data.range_value) for name, data in calibrator.compute_data().items()}
    except CalibrationError:
        raise
    except Exception as e:  # onnxruntime raises bare Exceptions/ValueErrors/its own Fail types
        raise LowerError(f"onnxruntime could not calibrate the model with {options.method} "
                         f"({type(e).__name__}: {e})") from e
    ranges = {}
    for name, (lo, hi) in measured.items():
        lo, hi = np.float32(lo), np.float32(hi)
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise CalibrationError(f"calibration measured a non-finite range [{lo}, {hi}] for tensor {name!r}: the "
                                   "float model overflows on the calibration data")
        ranges[name] = (lo, hi)
    return ranges


def entropy_ranges(calibrator: Any, reader: "BatchReader") -> dict[str, tuple[Any, Any]]:
    """KL-divergence thresholds (TensorRT's entropy calibration) from fixed-resolution histograms.

    onnxruntime's own histograms grow at the first batch's bin width when a later batch reaches
    further, which can mean tens of thousands of bins and a KL search that takes minutes per tensor.
    Here each tensor keeps HISTOGRAM_BINS bins over [-max|x|, max|x|]; a wider batch re-bins the
    counts so far onto the wider range. The calibrator provides the model with every tensor to
    calibrate as an output; onnxruntime's KL search picks the threshold.
    """
    from onnxruntime.quantization.calibrate import HistogramCollector

    session = calibrator.infer_session
    outputs = [o.name for o in session.get_outputs()]
    wanted = set(calibrator.tensors_to_calibrate)
    histograms: dict[str, Histogram] = {}
    for i in range(len(reader)):
        reader.set_range(i, i + 1)
        batch = reader.get_next()
        for name, value in zip(outputs, session.run(None, batch)):
            if name in wanted:
                histograms[name] = _accumulate(histograms.get(name), np.asarray(value), name)
    search = HistogramCollector(method="entropy", symmetric=True, num_bins=HISTOGRAM_BINS,
                                num_quantized_bins=QUANTIZED_BINS, percentile=100.0, scenario="same")
    ranges = {}
    for name, h in sorted(histograms.items()):
        edges = np.linspace(-h.bound, h.bound, HISTOGRAM_BINS + 1, dtype=np.float32)
        ranges[name] = tuple(search.get_entropy_threshold((h.counts, edges, np.float32(h.low), np.float32(h.high)),
                                                          QUANTIZED_BINS))
    return ranges


@dataclass(frozen=True)
class Histogram:
    """One tensor's values so far: counts in HISTOGRAM_BINS bins over [-bound, bound], min and max."""

    counts: np.ndarray
    bound: float
    low: float
    high: float


def _accumulate(previous: Histogram | None, value: np.ndarray, name: str) -> Histogram:
    x = value.astype(np.float32, copy=False).ravel()
    low, high = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
    if not (np.isfinite(low) and np.isfinite(high)):
        raise CalibrationError(f"tensor {name!r} is not finite on the calibration data (values in [{low}, {high}]): "
                               "the float model overflows or divides by zero on it")
    bound = max(abs(low), abs(high), previous.bound if previous else 0.0) or 1.0
    counts = np.histogram(x, HISTOGRAM_BINS, range=(-bound, bound))[0].astype(np.int64)
    if previous is None:
        return Histogram(counts, bound, low, high)
    old = previous.counts
    if previous.bound != bound:  # re-bin the counts so far, at their bins' centres, onto the wider range
        centres = (np.arange(HISTOGRAM_BINS) + 0.5) * (2 * previous.bound / HISTOGRAM_BINS) - previous.bound
        old = np.rint(np.histogram(centres, HISTOGRAM_BINS, range=(-bound, bound), weights=old)[0]).astype(np.int64)
    return Histogram(counts + old, bound, min(low, previous.low), max(high, previous.high))


def pre_process(src: Path, dest: Path) -> bool:
    """onnxruntime's quantization pre-processing; symbolic shape inference is skipped when it cannot
    resolve the graph's dynamic dims. Returns whether it ran."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(dest))
        return True
    except Exception as e:  # "Incomplete symbolic shape inference" is a bare Exception
        log(logger, logging.DEBUG, "symbolic shape inference failed; pre-processing without it", error=str(e))
    try:
        quant_pre_process(str(src), str(dest), skip_symbolic_shape=True)
    except Exception as e:
        raise LowerError(f"onnxruntime's quantization pre-processing failed ({type(e).__name__}: {e})") from e
    return False


def resolve_keep_float(original: Any, graph_model: Any, keep: Sequence[str]) -> tuple[list[str], list[str]]:
    """(node names, op types) to keep in float, from names, op types and the keywords first/last.

    Names resolve against `graph_model` (the pre-processed graph that is quantized); a name that
    only `original` has was folded into another node by pre-processing, and is reported as such.
    """
    import onnx

    graph = graph_model.graph
    names = {n.name for n in graph.node}
    present_types = {n.op_type for n in graph.node}
    nodes: list[str] = []
    op_types: list[str] = []
    for entry in keep:
        if entry in KEYWORDS:
            nodes.append(_weighted_layer(graph_model, entry))
        elif entry in names:
            nodes.append(entry)
        elif onnx.defs.has(entry):
            if entry not in present_types:
                raise CalibrationError(f"keep-float op type {entry!r} does not occur in the model; its op types "
                                       f"are {', '.join(sorted(present_types))}")
            op_types.append(entry)
        elif entry in {n.name for n in original.graph.node}:
            raise CalibrationError(f"keep-float node {entry!r} was fused into another node by onnxruntime's "
                                   "pre-processing (BatchNorm, Mul and Add fold into convolutions); name the node "
                                   "it was folded into, or its op type")
        else:
            raise CalibrationError(f"keep-float {entry!r} is neither a node name nor an op type of the model, nor "
                                   f"one of {', '.join(KEYWORDS)} (node names are those of model.onnx)")
    return sorted(set(nodes)), sorted(set(op_types))


def _weighted_layer(model: Any, which: str) -> str:
    """The first or last Conv/MatMul/Gemm with a constant weight, in graph order (ONNX requires
    graph.node to be topologically sorted). Activation x activation MatMuls (attention) are not
    layers, and are skipped."""
    graph = model.graph
    constants = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    layers = [n.name for n in graph.node if n.op_type in WEIGHTED_OP_TYPES and len(n.input) > 1 and n.input[1] in constants]
    if not layers:
        raise CalibrationError(f"keep-float {which!r}: the model has no {'/'.join(WEIGHTED_OP_TYPES)} layer with "
                               "constant weights")
    return layers[0] if which == "first" else layers[-1]


def _quantizable_op_types() -> list[str]:
    """onnxruntime's default: every op type its QDQ or QOperator quantizers handle."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QDQRegistry) | set(QLinearOpsRegistry))


def _samples(arrays: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(arrays.values())).shape[0])


class BatchReader:
    """onnxruntime's CalibrationDataReader over in-memory arrays, in batches of `batch` samples.

    `__len__` and `set_range` (in batches) let the quantizer collect ranges one batch at a time.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch: int) -> None:
        n = _samples(arrays)
        self._batches = [{k: v[i:i + batch] for k, v in arrays.items()} for i in range(0, n, batch)]
        self.set_range(0, len(self._batches))

    def __len__(self) -> int:
        return len(self._batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._iter = iter(self._batches[start_index:end_index])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)

    def rewind(self) -> None:
        self.set_range(0, len(self._batches))


@contextlib.contextmanager
def _quiet_onnxruntime() -> Iterator[None]:
    """onnxruntime's quantizer prints progress and logs warnings through the root logger; keep them
    at debug level so lowering stays quiet."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        root.setLevel(level)
        if out.getvalue().strip():
            log(logger, logging.DEBUG, "onnxruntime quantization output", output=out.getvalue().strip()[-2000:])
