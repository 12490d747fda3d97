"""The public face of the runtime: load a model package, check inputs, run it."""
from __future__ import annotations

import asyncio
import operator
import os
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .batch_streams import streamed
from .call_teams import call_teams
from .devices import get_device, resolve_device
from .engine import read_engine
from .errors import InputError
from .kernels import omp
from .onnx_import import load_package_graph
from .package import ENGINES, Manifest, TensorSpec, open_package
from .run_threads import run_threads


def check_feeds(specs: list[TensorSpec], feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inputs exactly as the model declares them, or an InputError naming the tensor at fault."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"inputs must be a mapping of tensor name to array, got {type(feeds).__name__}")
    by_name = {t.name: t for t in specs}
    unknown = [k for k in feeds if k not in by_name]
    if unknown:
        raise InputError(f"unknown input {unknown[0]!r}; the model's inputs are: {describe(specs)}")
    missing = [t.name for t in specs if t.name not in feeds]
    if missing:
        raise InputError(f"missing input {missing[0]!r}; the model's inputs are: {describe(specs)}")
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        x = feeds[spec.name]
        if not isinstance(x, np.ndarray):
            raise InputError(f"input {spec.name!r}: expected a numpy array of {spec.dtype}, got {type(x).__name__}")
        if x.dtype != np.dtype(spec.dtype):
            raise InputError(f"input {spec.name!r}: expected dtype {spec.dtype}, got {x.dtype}")
        if x.ndim != len(spec.shape) or any(d != -1 and d != g for d, g in zip(spec.shape, x.shape)):
            raise InputError(f"input {spec.name!r}: expected shape {_shape(spec.shape)}, got {list(x.shape)}")
        if x.size == 0:
            raise InputError(f"input {spec.name!r}: empty tensor (shape {list(x.shape)}); expected at least one element")
        out[spec.name] = x
    return out


class FeedCheck:
    """check_feeds for one model's inputs, with the common case (exactly the declared inputs, each
    an array of the right dtype and shape) decided in one pass over precomputed expectations; any
    other feeds go through check_feeds, which names what is wrong."""

    def __init__(self, specs: list[TensorSpec]) -> None:
        self.specs = specs
        # per input: name, dtype, rank, and its fixed dimensions as a getter of a shape and what it must give
        self._expected = [(t.name, np.dtype(t.dtype), len(t.shape), *_fixed_dims(t.shape)) for t in specs]

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if type(feeds) is dict and len(feeds) == len(self._expected):
            for name, dtype, ndim, fixed, want in self._expected:
                x = feeds.get(name)
                if type(x) is not np.ndarray or x.dtype != dtype or x.ndim != ndim or not x.size or fixed(x.shape) != want:
                    break
            else:
                return dict(feeds)
        return check_feeds(self.specs, feeds)


def _fixed_dims(shape: tuple[int, ...]) -> tuple[Callable[[tuple[int, ...]], Any], Any]:
    """A getter of a shape's fixed dimensions (the ones not -1) and the value it must return."""
    at = [i for i, d in enumerate(shape) if d != -1]
    if not at:
        return (lambda _shape: ()), ()
    getter = operator.itemgetter(*at)
    return getter, getter(shape)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]"


def describe(specs: list[TensorSpec]) -> str:
    return ", ".join(f"{t.name} ({t.dtype} {_shape(t.shape)})" for t in specs)


class Model:
    """A loaded model: thread-safe `predict`, `predict_async` (a Future), awaitable `infer`."""

    def __init__(self, package_dir: Path, manifest: Manifest, executable: Any, graph_inputs: list[str], graph_outputs: list[str], device: str, engine: dict[str, Any] | None) -> None:
        self.package_dir = package_dir
        self.manifest = manifest
        self.name = manifest.name
        self.version = manifest.version
        self.inputs: list[TensorSpec] = list(manifest.inputs)
        self.outputs: list[TensorSpec] = list(manifest.outputs)
        self.device = device
        self.engine = engine
        self.engine_key: str | None = engine["key"] if engine else None
        # what verification tolerances follow from: host models compiled from ONNX are fp32
        self.precision: str = engine["target"]["precision"] if engine else "fp32"
        self._exe = executable
        self._input_order = graph_inputs
        self._output_names = graph_outputs
        self._check_feeds = FeedCheck(self.inputs)

    def __repr__(self) -> str:
        return f"Model({self.name!r}, version={self.version!r}, device={self.device!r})"

    def validate_inputs(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return self._check_feeds(feeds)

    def _run_checked(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self._exe.run([feeds[n] for n in self._input_order])
        return dict(zip(self._output_names, results))

    def predict(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return self._run_checked(self.validate_inputs(feeds))

    def predict_alone(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """A run on the calling thread by itself, with no OpenMP team: for a thread that runs short
        requests between other work (serving's event loop), where a team of its own would be the
        process's second (run_threads.py) and its sleeping member's wake-up costs what it saves."""
        with omp.Alone():
            return self.predict(feeds)

    def predict_async(self, feeds: Mapping[str, Any]) -> Future[dict[str, np.ndarray]]:
        """Check the inputs and start a run; the Future resolves to the outputs. No thread is
        parked waiting for it: a dataflow executable completes it from its own kernels, any other
        runs on the runtime's run threads (one at a time: the same thread and OpenMP team)."""
        checked = self.validate_inputs(feeds)
        run_async = getattr(self._exe, "run_async", None)
        if run_async is None:
            return run_threads().submit(self._run_checked, checked)
        named: Future[dict[str, np.ndarray]] = Future()
        run_async([checked[n] for n in self._input_order]).add_done_callback(partial(self._name_outputs, named))
        return named

    def _name_outputs(self, named: Future[dict[str, np.ndarray]], done: Future[list[np.ndarray]]) -> None:
        try:
            named.set_result(dict(zip(self._output_names, done.result())))
        except BaseException as e:  # noqa: BLE001 - whatever failed the run fails the caller's Future
            named.set_exception(e)

    async def infer(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return await asyncio.wrap_future(self.predict_async(feeds))


def load_model(package_dir: str | os.PathLike[str], device: str = "host", *, engine_key: str | None = None, engine_dir: str | os.PathLike[str] | None = None, verify: bool = True, executor: str | None = None) -> Model:
    """Load a model package for `device` (host, cuda, tensorrt or auto).

    With `engine_key` (the engine in the package's engines/<key>/) or an explicit `engine_dir`,
    the engine built for this node type is used, after checking its digests and that its key
    matches this node; without either, the host device compiles model.onnx directly.
    """
    package_dir = Path(package_dir)
    manifest = open_package(package_dir, verify=verify)
    if engine_key is not None:
        if engine_dir is not None:
            raise ValueError("give engine_key or engine_dir, not both")
        engine_dir = package_dir / ENGINES / engine_key
    engine = None
    if engine_dir is not None:
        engine = read_engine(engine_dir, manifest)
        device = engine["backend"] if device == "auto" else device
        if engine["backend"] != device:
            raise ValueError(f"engine {engine['key']} is for device {engine['backend']}, not {device}")
    name = resolve_device(device)
    dev = get_device(name)
    dev.check_available()
    precision = str(engine["target"].get("precision", "fp32")) if engine else "fp32"
    graph = load_package_graph(package_dir, manifest, precision)
    options = dict(engine.get("options", {})) if engine else {}
    if engine_dir is not None:
        options["engine_dir"] = str(engine_dir)
    if executor is not None:
        options["executor"] = executor
    graph_inputs = [v.name for v in graph.inputs]
    graph_outputs = [v.name for v in graph.outputs]
    exe = call_teams(streamed(dev.prepare(graph, options)))
    return Model(package_dir, manifest, exe, graph_inputs, graph_outputs, name, engine)
