"""Calibration data: what a user really has, read into one array per model input.

INT8 scales are measured on this data, so it must look like what the model will serve: an .npz
with one array per input, a directory of .npy files, or a directory of images (one class per
subdirectory, as an ImageFolder) decoded and preprocessed the way the model expects. Everything
is checked against the model's inputs before any slow work starts, and a seeded split keeps some
samples out of calibration, so accuracy is later measured on data the scales never saw.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kubetrt.pipeline.errors import LowerError
from kubetrt.pipeline.sources import SourceError, fetch_tree, parse_uri, s3_client, s3_error
from kubetrt.runtime.package import TensorSpec

METHODS = ("minmax", "percentile", "entropy")
DEFAULT_METHOD = "minmax"
DEFAULT_PERCENTILE = 99.999  # onnxruntime's default: clips only the rarest outliers
DEFAULT_HOLDOUT = 0.2
MIN_SAMPLES = 2  # at least one to calibrate on and one held out to measure accuracy
LABELS = "labels"  # the .npz key (and <dir>/labels.npy) holding task labels, unless an input has that name
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")

# keras.applications' preprocessing modes (and torchvision's ImageNet normalization), on RGB 0..255.
PRESETS = ("none", "unit", "tf", "caffe", "torch")
CAFFE_BGR_MEAN = np.array([103.939, 116.779, 123.68], np.float32)
TORCH_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
TORCH_STD = np.array([0.229, 0.224, 0.225], np.float32)

KINDS = ("npz", "npy", "npy-samples", "images")  # npy: <input>.npy per input; npy-samples: a file per sample
FORMATS = ("an .npz with one array per model input, a directory of .npy files (<input>.npy per input, or one "
           f"file per sample), or a directory of images ({'/'.join(s[1:] for s in IMAGE_SUFFIXES)}, optionally "
           "one subdirectory per class)")


class CalibrationError(LowerError):
    """Calibration data or options are missing, malformed, or do not fit the model's inputs."""


@dataclass(frozen=True)
class CalibrationOptions:
    """How to calibrate: the data, how much of it to hold out, the range method, what stays float.

    Invalid values are refused at construction, so a bad option fails before any data is read.
    """

    source: str  # local path to the data (remote URIs are fetched first: fetch_calibration)
    holdout: float = DEFAULT_HOLDOUT  # fraction of samples kept out of calibration, for accuracy
    method: str = DEFAULT_METHOD
    percentile: float | None = None  # percentile method only; default DEFAULT_PERCENTILE
    keep_float: tuple[str, ...] = ()  # node names, op types, "first", "last"
    preprocess: str | None = None  # images only: a PRESETS name or "module:function"
    uri: str = ""  # where the data came from, as the manifest records it (default: the source path)

    def __post_init__(self) -> None:
        if not str(self.source):
            raise CalibrationError(f"no calibration data given; expected {FORMATS}")
        if self.method not in METHODS:
            raise CalibrationError(f"calibration method {self.method!r}: expected one of {', '.join(METHODS)}")
        if self.percentile is not None:
            if self.method != "percentile":
                raise CalibrationError(f"a percentile ({self.percentile}) only applies to --calibration-method "
                                       f"percentile, not {self.method}")
            if not (math.isfinite(self.percentile) and 0 < self.percentile <= 100):
                raise CalibrationError(f"percentile {self.percentile}: expected a number in (0, 100], e.g. 99.99")
        if not (math.isfinite(self.holdout) and 0 < self.holdout < 1):
            raise CalibrationError(f"holdout fraction {self.holdout}: expected a number between 0 and 1 "
                                   f"(exclusive), e.g. {DEFAULT_HOLDOUT}")
        if any(not isinstance(k, str) or not k.strip() for k in self.keep_float):
            raise CalibrationError(f"keep-float entries {list(self.keep_float)}: expected node names, op types, "
                                   "'first' or 'last'")
        if self.preprocess is not None and self.preprocess not in PRESETS and not _is_callable_spec(self.preprocess):
            raise CalibrationError(f"preprocessing {self.preprocess!r}: expected one of {', '.join(PRESETS)} or "
                                   "MODULE:FUNCTION (a Python function taking the uint8 NHWC batch)")

    @property
    def percentile_value(self) -> float | None:
        """The percentile the percentile method clips at; None for the other methods."""
        if self.method != "percentile":
            return None
        return self.percentile if self.percentile is not None else DEFAULT_PERCENTILE

    @property
    def described(self) -> str:
        """The data's location for the manifest: the URI it was fetched from, else its absolute path."""
        return self.uri or str(Path(self.source).resolve())


@dataclass(frozen=True)
class CalibrationData:
    """Samples for every model input (N on axis 0, in the input's dtype) and optional task labels."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None
    kind: str  # one of KINDS
    source: str
    classes: tuple[str, ...] = ()  # image class subdirectories, in label order

    @property
    def samples(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    @property
    def digest(self) -> str:
        return data_digest(self.inputs, self.labels)

    def take(self, indices: np.ndarray) -> "CalibrationData":
        """The samples at `indices`, in that order."""
        return CalibrationData({k: v[indices] for k, v in self.inputs.items()},
                               None if self.labels is None else self.labels[indices], self.kind, self.source,
                               self.classes)


@dataclass(frozen=True)
class PreparedCalibration:
    """Calibration data read, checked and split: what lowering quantizes with and measures on."""

    options: CalibrationOptions
    data: CalibrationData  # everything the user gave
    calibrate: CalibrationData  # the part the ranges are measured on
    heldout: CalibrationData  # never used to calibrate
    seed: int = 0

    def record(self) -> dict[str, Any]:
        """The manifest's account of the data: where from, what kind, its digest, how it was split."""
        return {"source": self.options.described, "kind": self.data.kind, "digest": self.data.digest,
                "samples": self.calibrate.samples, "heldout_samples": self.heldout.samples,
                "holdout": self.options.holdout, "seed": self.seed,
                **({"preprocess": self.options.preprocess} if self.options.preprocess else {})}

    def heldout_record(self) -> dict[str, Any]:
        """Manifest.heldout: what heldout.npz holds."""
        return {"samples": self.heldout.samples, "labels": self.heldout.labels is not None,
                "source": self.options.described, "digest": self.heldout.digest,
                **({"classes": list(self.data.classes)} if self.data.classes else {})}


def prepare_calibration(options: CalibrationOptions, specs: Sequence[TensorSpec], seed: int = 0) -> PreparedCalibration:
    """Read the data for a model with inputs `specs` and split off the held-out samples."""
    data = read_calibration(options, specs)
    calibrate, heldout = split(data, options.holdout, seed)
    return PreparedCalibration(options, data, calibrate, heldout, seed)


def check_source(options: CalibrationOptions) -> Path:
    """The data's path; CalibrationError at once if nothing is there (before a SavedModel is read)."""
    path = Path(options.source)
    if not path.exists():
        raise CalibrationError(f"{path}: calibration data not found; expected {FORMATS}")
    return path


# --------------------------------------------------------------------------- reading


def read_calibration(options: CalibrationOptions, specs: Sequence[TensorSpec]) -> CalibrationData:
    """The data at `options.source` as arrays that fit `specs`; CalibrationError naming what does not."""
    path = check_source(options)
    kind = detect_kind(path)
    if options.preprocess is not None and kind != "images":
        raise CalibrationError(f"{path}: preprocessing ({options.preprocess}) applies to image directories only; "
                               f"{kind} data is fed to the model as it is")
    if kind == "images":
        return _read_images(path, specs, options.preprocess)
    if kind == "npz":
        arrays, labels = _read_npz(path, specs)
        return _checked(arrays, labels, specs, kind, path)
    files = _visible(path)
    if {p.stem for p in files} & {*(t.name for t in specs), LABELS}:
        arrays, labels = _split_labels({p.stem: _load_npy(p) for p in files}, specs)
        return _checked(arrays, labels, specs, "npy", path)
    return _checked(_stack_samples(path, files, specs), None, specs, "npy-samples", path)


def detect_kind(path: Path) -> str:
    """"npz", "npy" (a directory of .npy files) or "images", judged by names only; CalibrationError
    for anything else."""
    if path.is_file():
        if path.suffix.lower() == ".npz":
            return "npz"
        raise CalibrationError(f"{path}: unknown calibration data format {path.suffix or '(no suffix)'!r}; "
                               f"expected {FORMATS}")
    entries = _visible(path)
    if not entries:
        raise CalibrationError(f"{path}: empty directory; expected {FORMATS}")
    npy = [p for p in entries if p.is_file() and p.suffix.lower() == ".npy"]
    images = [p for p in entries if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    dirs = [p for p in entries if p.is_dir()]
    if len(npy) == len(entries):
        return "npy"
    if len(images) == len(entries) or len(dirs) == len(entries):
        return "images"
    odd = [p.name for p in entries if p not in npy and p not in images and p not in dirs]
    found = (f"{', '.join(odd[:5])}{' ...' if len(odd) > 5 else ''}" if odd
             else "a mix of " + " and ".join(w for w, group in (("class subdirectories", dirs), (".npy files", npy),
                                                                 ("images", images)) if group))
    raise CalibrationError(f"{path}: unknown calibration data format: found {found}; expected {FORMATS}")


def _visible(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if not p.name.startswith("."))


def _read_npz(path: Path, specs: Sequence[TensorSpec]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CalibrationError(f"{path}: not a readable .npz ({type(e).__name__}: {e}); expected {FORMATS}") from e
    return _split_labels(arrays, specs)


def _split_labels(arrays: dict[str, np.ndarray], specs: Sequence[TensorSpec]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """`labels` holds task labels, unless the model has an input of that name."""
    if LABELS in arrays and LABELS not in {t.name for t in specs}:
        return {k: v for k, v in arrays.items() if k != LABELS}, arrays[LABELS]
    return arrays, None


def _stack_samples(path: Path, files: list[Path], specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """One .npy per sample (a single-input model), stacked in name order."""
    if len(specs) != 1:
        raise CalibrationError(f"{path}: missing model input(s) {', '.join(t.name for t in specs)}: one .npy per "
                               "sample fits a single-input model only; for several inputs give one <input>.npy per "
                               "input (N samples each) or an .npz")
    spec = specs[0]
    samples = [_load_npy(p) for p in files]
    for p, s in zip(files, samples):
        if s.shape != samples[0].shape:
            raise CalibrationError(f"{path}: per-sample .npy files differ in shape ({files[0].name} is "
                                   f"{list(samples[0].shape)}, {p.name} is {list(s.shape)}); each must hold one "
                                   f"sample of input {spec.name!r}, shape {list(spec.shape[1:])}")
    return {spec.name: np.stack(samples)}


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.asarray(np.load(path, allow_pickle=False))
    except (OSError, ValueError, EOFError) as e:
        raise CalibrationError(f"{path}: not a readable .npy ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------- images


def _read_images(path: Path, specs: Sequence[TensorSpec], preprocess: str | None) -> CalibrationData:
    spec = _image_input(path, specs)
    if preprocess is None:
        raise CalibrationError(f"{path}: image calibration data needs --preprocess: how the model expects its "
                               f"pixels ({', '.join(PRESETS)}, or MODULE:FUNCTION taking the uint8 batch)")
    _, height, width, channels = spec.shape
    files, labels, classes = _image_files(path)
    batch = np.stack([_decode(p, height, width, channels) for p in files])
    arrays = {spec.name: _preprocess(batch, preprocess, path)}
    data = _checked(arrays, labels, specs, "images", path)
    return CalibrationData(data.inputs, data.labels, data.kind, data.source, classes)


def _image_input(path: Path, specs: Sequence[TensorSpec]) -> TensorSpec:
    shapes = ", ".join(f"{t.name}:{t.dtype}{list(t.shape)}" for t in specs)
    if len(specs) != 1:
        raise CalibrationError(f"{path}: image calibration data fits a model with one image input; this model "
                               f"has {len(specs)}: {shapes}; give an .npz with one array per input")
    spec = specs[0]
    s = spec.shape
    if len(s) != 4 or s[1] <= 0 or s[2] <= 0 or s[3] not in (1, 3):
        raise CalibrationError(f"{path}: image calibration data needs an NHWC image input of shape [-1, H, W, 1|3] "
                               f"with static H and W; the model's input is {shapes}")
    return spec


def _image_files(path: Path) -> tuple[list[Path], np.ndarray | None, tuple[str, ...]]:
    entries = _visible(path)
    if all(p.is_file() for p in entries):
        return entries, None, ()
    classes = tuple(p.name for p in entries)
    files: list[Path] = []
    labels: list[int] = []
    for index, class_dir in enumerate(entries):
        members = _visible(class_dir)
        bad = [p.name + ("/" if p.is_dir() else "") for p in members
               if not (p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)]
        if bad:
            raise CalibrationError(f"{class_dir}: class directory holds {', '.join(bad[:5])}; expected only image "
                                   f"files ({', '.join(IMAGE_SUFFIXES)})")
        if not members:
            raise CalibrationError(f"{class_dir}: class directory holds no images")
        files += members
        labels += [index] * len(members)
    return files, np.asarray(labels, np.int64), classes


def _decode(path: Path, height: int, width: int, channels: int) -> np.ndarray:
    """RGB (or L) uint8 [H, W, C], resized (bilinear) to the model's size."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img = img.convert("L" if channels == 1 else "RGB")
            if img.size != (width, height):
                img = img.resize((width, height), Image.Resampling.BILINEAR)
            array = np.asarray(img, np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise CalibrationError(f"{path}: unreadable image ({type(e).__name__}: {e})") from e
    return array.reshape(height, width, channels)


def _preprocess(batch: np.ndarray, preprocess: str, where: Path) -> np.ndarray:
    """keras.applications-style presets on the uint8 RGB batch, or the user's function."""
    if preprocess not in PRESETS:
        fn = load_function(preprocess)
        try:
            result = fn(batch.copy())
        except Exception as e:  # the user's code: report whatever it raised
            raise CalibrationError(f"preprocessing function {preprocess} failed on the {batch.shape[0]} images in "
                                   f"{where} ({type(e).__name__}: {e})") from e
        if not isinstance(result, np.ndarray):
            raise CalibrationError(f"preprocessing function {preprocess} returned {type(result).__name__}; expected "
                                   "a numpy array with one row per image")
        return result
    if preprocess == "none":
        return batch
    x = batch.astype(np.float32)
    if preprocess == "unit":
        return x / np.float32(255)
    if preprocess == "tf":
        return x / np.float32(127.5) - np.float32(1)
    if batch.shape[-1] != 3:
        raise CalibrationError(f"{where}: preprocessing {preprocess!r} normalizes 3 RGB channels; the model's images "
                               f"have {batch.shape[-1]}")
    if preprocess == "caffe":
        return x[..., ::-1] - CAFFE_BGR_MEAN
    return (x / np.float32(255) - TORCH_MEAN) / TORCH_STD


def _is_callable_spec(text: str) -> bool:
    module, sep, name = text.rpartition(":")
    return bool(sep and module and name.isidentifier())


def load_function(spec: str) -> Callable[[np.ndarray], Any]:
    """`package.module:function` (importable) or `path/to/file.py:function`."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise CalibrationError(f"preprocessing {spec}: file {file} does not exist")
            loader = importlib.util.spec_from_file_location(f"kubetrt_preprocess_{file.stem}", file)
            if loader is None or loader.loader is None:
                raise CalibrationError(f"preprocessing {spec}: cannot load {file} as Python")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except CalibrationError:
        raise
    except Exception as e:  # ImportError, or whatever the module raises at import
        raise CalibrationError(f"preprocessing {spec}: cannot import {module_name} ({type(e).__name__}: {e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CalibrationError(f"preprocessing {spec}: {module_name} has no function {attr!r}")
    return fn


# --------------------------------------------------------------------------- checks


def _checked(arrays: Mapping[str, np.ndarray], labels: np.ndarray | None, specs: Sequence[TensorSpec], kind: str,
             path: Path) -> CalibrationData:
    """Every input present, nothing extra, the model's per-sample shape and dtype, one N, >= 2, finite."""
    names = [t.name for t in specs]
    missing = [n for n in names if n not in arrays]
    extra = sorted(set(arrays) - set(names))
    expected = ", ".join(f"{t.name}:{t.dtype}{list(t.shape)}" for t in specs)
    if missing:
        raise CalibrationError(f"{path}: missing model input(s) {', '.join(missing)}; the model's inputs are "
                               f"{expected}")
    if extra:
        raise CalibrationError(f"{path}: extra array(s) {', '.join(extra)} that are not model inputs (inputs: "
                               f"{expected}; task labels go under {LABELS!r})")
    result = {t.name: _fit(arrays[t.name], t, path) for t in specs}
    counts = {n: a.shape[0] for n, a in result.items()}
    if labels is not None:
        labels = np.asarray(labels)
        if labels.ndim == 0:
            raise CalibrationError(f"{path}: {LABELS} is a scalar; expected one label per sample")
        counts[LABELS] = labels.shape[0]
    if len(set(counts.values())) != 1:
        raise CalibrationError(f"{path}: inputs have different sample counts "
                               f"({', '.join(f'{k}: {v}' for k, v in counts.items())}); expected the same N on axis 0")
    n = next(iter(counts.values()))
    if n < MIN_SAMPLES:
        raise CalibrationError(f"{path}: {n} sample(s); need at least {MIN_SAMPLES} (at least one to calibrate on "
                               "and one held out to measure accuracy), and better a few hundred")
    return CalibrationData(result, labels, kind, str(path))


def _fit(array: np.ndarray, spec: TensorSpec, path: Path) -> np.ndarray:
    want = np.dtype(spec.dtype)
    where = f"{path}: input {spec.name!r}"
    tail = list(spec.shape[1:])
    if array.ndim != len(spec.shape) or any(d >= 0 and d != g for d, g in zip(spec.shape[1:], array.shape[1:])):
        got = list(array.shape[1:]) if array.ndim else []
        raise CalibrationError(f"{where} has shape {list(array.shape)} (samples of {got}); expected N samples of "
                               f"{tail} (the input's shape is {list(spec.shape)}, -1 for any size)")
    if array.dtype != want and not np.can_cast(array.dtype, want, casting="same_kind"):
        raise CalibrationError(f"{where} is {array.dtype}; the model takes {want} and {array.dtype} does not convert "
                               "to it without losing its kind (e.g. floats into integers)")
    if np.issubdtype(want, np.integer) and np.issubdtype(array.dtype, np.integer) and array.size:
        lo, hi = np.iinfo(want).min, np.iinfo(want).max
        if array.min() < lo or array.max() > hi:
            raise CalibrationError(f"{where} holds values in [{array.min()}, {array.max()}], outside {want}'s range "
                                   f"[{lo}, {hi}]")
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow to inf is reported just below
        array = np.ascontiguousarray(array, dtype=want)
    if np.issubdtype(want, np.inexact) and not np.isfinite(array).all():
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise CalibrationError(f"{where} holds {bad} non-finite value(s) (NaN or inf) as {want}; calibration needs "
                               "finite data")
    return array


# --------------------------------------------------------------------------- split, digest


def split(data: CalibrationData, holdout: float = DEFAULT_HOLDOUT, seed: int = 0) -> tuple[CalibrationData, CalibrationData]:
    """(calibration, held-out): a seeded permutation, at least one sample on each side, each side in
    the data's own order. The same data, fraction and seed always give the same split."""
    n = data.samples
    if n < MIN_SAMPLES:
        raise CalibrationError(f"{data.source}: {n} sample(s); need at least {MIN_SAMPLES} to hold one out")
    held = min(max(round(n * holdout), 1), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    return data.take(np.sort(order[held:])), data.take(np.sort(order[:held]))


def data_digest(inputs: Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> str:
    """sha256 over names, dtypes, shapes and bytes of the arrays: the data as the model sees it."""
    h = hashlib.sha256()
    items = sorted(inputs.items()) + ([(f"\0{LABELS}", labels)] if labels is not None else [])
    for name, array in items:
        a = np.ascontiguousarray(array)
        h.update(f"{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.reshape(-1).view(np.uint8).data if a.dtype.itemsize else b"")
    return "sha256:" + h.hexdigest()


# --------------------------------------------------------------------------- remote data


def fetch_options(options: CalibrationOptions, workdir: str | os.PathLike[str], *,
                  s3_endpoint: str | None = None) -> CalibrationOptions:
    """`options` whose source is a local path: a remote URI is fetched under `workdir` and kept as
    the `uri` the manifest records; file:// URIs become their paths."""
    if parse_uri(options.source).scheme == "file":
        return replace(options, source=str(fetch_calibration(options.source, workdir)))
    local = fetch_calibration(options.source, workdir, s3_endpoint=s3_endpoint)
    return replace(options, source=str(local), uri=options.uri or options.source)


def fetch_calibration(uri: str, workdir: str | os.PathLike[str], *, s3_endpoint: str | None = None) -> Path:
    """A local path for calibration data at `uri`: local paths as they are, s3:// objects (an .npz)
    or prefixes (a directory) and gs:// prefixes downloaded under `workdir`."""
    loc = parse_uri(uri)
    if loc.scheme == "file":
        return Path(loc.path)
    dest = Path(workdir) / "calibration"
    if loc.path.lower().endswith(".npz"):
        if loc.scheme != "s3":
            raise SourceError(f"{uri}: a single calibration file is fetched from s3:// only; on {loc.scheme}:// "
                              "give a prefix holding .npy or image files")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / Path(loc.path).name
        from botocore import exceptions as bx

        client = s3_client(s3_endpoint)
        try:
            client.download_file(loc.bucket, loc.path, str(target))
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise s3_error(loc, e, client) from e
        return target
    return fetch_tree(loc, dest, s3_endpoint=s3_endpoint)
