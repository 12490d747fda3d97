"""Loaded models: load, golden warm-up, readiness, lookup by name/version, one batcher each.

A model becomes ready only after it loaded and reproduced its package's golden (TensorFlow)
outputs within the tolerance its engine was verified at (the table's for its precision and device
class when it has no verified engine); until then, or after a mismatch, it answers 503 and says
why (log line, OIP metadata `reason`).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from kubetrt import runtime
from kubetrt.telemetry.logs import log
from kubetrt.runtime.accuracy import CALIBRATED_PRECISIONS, Tolerance, check_heldout, compare, device_class, tolerance_for
from kubetrt.runtime.package import HeldOut, Manifest, TensorSpec, load_golden, load_heldout, read_manifest

from .batcher import BatchComputeError, Batcher, BatcherClosed, BatcherConfig, DeadlineExceeded, QueueFull
from .errors import BadRequest, ComputeFailed, NotFound, Overloaded, Timeout, Unavailable
from .metrics import ModelMetrics, ServingMetrics
from .request_trace import RequestTraces
from .tensors import is_bytes_dtype

logger = logging.getLogger("kubetrt.serving")

class ModelLike(Protocol):
    """What serving needs from kubetrt.runtime.Model (test doubles implement the same)."""

    name: str
    version: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    device: str
    package_dir: Any

    def predict(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def predict_alone(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def predict_async(self, feeds: Mapping[str, np.ndarray]) -> Future[dict[str, np.ndarray]]: ...

    def validate_inputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class State(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ServingConfig:
    device: str = "host"
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    request_timeout_s: float = 30.0
    max_body_bytes: int = 64 << 20
    golden_check: bool = True
    grpc_port: int | None = None  # the OIP gRPC endpoint's port (0: any free one); None: no gRPC
    grpc_host: str = "127.0.0.1"
    graceful_timeout_s: float = 30.0  # on shutdown, how long in-flight gRPC calls may take
    shared_memory: bool = False  # Triton's system shared memory extension (shared_memory.py)
    idle_poll_us: int = 500  # how long the loop polls for the next call after the last is answered (idle_polling.py)
    trace_file: str | None = None  # where traced calls' timestamps go, a JSON line each (request_trace.py); None: none traced
    trace_rate: int = 1000  # one call in this many is traced


HELDOUT_CHECK_SAMPLES = 64  # enough to catch a broken engine at load, few enough to load fast


def golden_mismatch(model: ModelLike, tol: Tolerance) -> str | None:
    """Run the package's golden inputs; None if every output matches, else the reason. A
    calibrated-precision engine is checked on held-out samples by its gate instead, as its
    verification was (runtime.accuracy.CALIBRATED_PRECISIONS)."""
    manifest = getattr(model, "manifest", None)
    if tol.precision in CALIBRATED_PRECISIONS and manifest is not None:
        heldout = load_heldout(model.package_dir, manifest)
        if heldout is None:
            return f"a {tol.precision} engine needs the package's held-out data, and it has none"
        # agreement with TensorFlow, not accuracy against labels: one miss in a few dozen samples
        # is a point and a half, noise that only the full held-out set verification ran on evens out
        head = HeldOut({k: v[:HELDOUT_CHECK_SAMPLES] for k, v in heldout.inputs.items()},
                       {k: v[:HELDOUT_CHECK_SAMPLES] for k, v in heldout.outputs.items()})
        result = check_heldout(model.predict, head, tol.precision, batch=8)
        return None if result["passed"] else f"held-out check: {result['summary']}"
    golden = load_golden(model.package_dir, manifest)
    if not golden:
        return "the package has no golden data to verify against"
    for batch, (ins, want) in sorted(golden.items()):
        reason = compare(model.predict(ins), want, tol).reason()
        if reason is not None:
            return f"golden batch {batch}, {reason}"
    return None


def warm_plans(model: ModelLike, sizes: Sequence[int]) -> list[int]:
    """Run the model once at each batch size the batcher forms, where the batcher's runs go
    (predict_async), so no request waits for the runtime to plan a new shape; -> the sizes run.
    Models with other dynamic dimensions, or string inputs, are left to plan on demand (their
    shapes are the requests')."""
    if any(-1 in t.shape[1:] or is_bytes_dtype(t.dtype) for t in model.inputs):
        return []
    for n in sizes:
        model.predict_async({t.name: np.zeros((n, *t.shape[1:]), dtype=t.dtype) for t in model.inputs}).result()
    return list(sizes)


def golden_tolerance(model: ModelLike, device: str) -> Tolerance:
    """The tolerance the model's engine was verified at, as its report recorded it (carried in the
    manifest's engine entry); the table's for its precision and device class only when no
    verified engine says otherwise (a host model compiled straight from model.onnx)."""
    manifest: Manifest | None = getattr(model, "manifest", None)
    entry = manifest.engine_entry(getattr(model, "engine_key", None)) if manifest is not None else None
    recorded = entry.get("tolerance") if entry is not None else None
    if recorded is not None:
        return Tolerance.from_json(recorded)
    return tolerance_for(_precision(model), device_class(device))


@dataclass(frozen=True)
class Loadable:
    """A local package to load, the engine in it to use, and whether its digests were just checked."""

    package_dir: Path
    engine_key: str | None = None
    checked: bool = False


@dataclass(frozen=True)
class ModelSource:
    """A model served under `name`/`version`, resolved to a local package only when it loads.

    Resolving (fetching from an object store, checking digests) runs in the background like
    loading, so a package that cannot be had leaves this model unready with the reason; the
    server stays up and its readiness probe says why.
    """

    name: str
    version: str
    resolve: Callable[[], Loadable]
    manifest: Manifest | None = None  # known before loading: metadata routes can describe the model early

    @classmethod
    def local(cls, package_dir: str | os.PathLike[str], engine_key: str | None = None) -> "ModelSource":
        m = read_manifest(package_dir)
        return cls(m.name, m.version, lambda: Loadable(Path(package_dir), engine_key), m)


def _load(source: Loadable, config: ServingConfig) -> ModelLike:
    from kubetrt.runtime import load_model  # the runtime's device libraries load only when serving

    return load_model(source.package_dir, config.device, engine_key=source.engine_key, verify=not source.checked)


def _precision(model: ModelLike) -> str:
    """The engine's precision (fp32 / fp16 / int8); host models compiled from ONNX are fp32."""
    engine = getattr(model, "engine", None) or {}
    return str(getattr(model, "precision", None) or engine.get("precision") or "fp32")


def _batchable(model: ModelLike) -> bool:
    """Merge requests only if every input and output has a dynamic dim 0 (the batch dim)."""
    return all(len(t.shape) > 0 and t.shape[0] == -1 for t in [*model.inputs, *model.outputs])


def _version_key(v: str) -> tuple[int, Any]:
    return (1, int(v)) if v.isdigit() else (0, v)


class ServedModel:
    """One model version behind one batcher, with its readiness and metrics."""

    def __init__(
        self,
        name: str,
        version: str,
        config: ServingConfig,
        metrics: ModelMetrics,
        source: ModelSource | None = None,
        model: ModelLike | None = None,
        traces: RequestTraces | None = None,
    ) -> None:
        self.name, self.version = name, version
        self.config = config
        self.metrics = metrics
        self.traces = traces
        self.source = source
        self.model = model
        self.state = State.LOADING
        self.reason = "loading"
        self.signature = ""
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        self.device = config.device
        self.batcher: Batcher | None = None
        if model is not None:
            self._describe(model)
        elif source is not None and source.manifest is not None:
            m = source.manifest
            self.signature, self.inputs, self.outputs = m.signature, list(m.inputs), list(m.outputs)

    def _describe(self, model: ModelLike) -> None:
        self.inputs, self.outputs = list(model.inputs), list(model.outputs)
        self.device = str(getattr(model, "device", self.config.device))
        manifest = getattr(model, "manifest", None)
        self.signature = getattr(manifest, "signature", "") or self.signature

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    def load(self) -> None:
        """Blocking: load (if given a package), verify against golden data, start the batcher.
        The calling thread runs the model no more: the runtime's workers for it go (release_team),
        leaving the batcher's run threads the process's only OpenMP teams."""
        try:
            self._load()
        finally:
            runtime.release_team()

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            if self.model is None and self.source is not None:
                self.model = _load(self.source.resolve(), self.config)
                self._describe(self.model)
            if self.model is None:
                raise ValueError("nothing to load: no model and no source")
            if self.config.golden_check:
                tol = golden_tolerance(self.model, self.device)
                reason = golden_mismatch(self.model, tol)
                if reason is not None:
                    self._fail(f"golden check failed on device {self.device} at {tol.describe()}: {reason}")
                    return
        except Exception as e:  # noqa: BLE001 - a broken package keeps its model unready, not the server down
            self._fail(f"load failed: {type(e).__name__}: {e}")
            return
        self.batcher = Batcher(
            self.model.predict_async,
            self.config.batcher,
            batchable=_batchable(self.model),
            observer=self.metrics,
            name=self.name,
            run_now=self.model.predict_alone,
        ).start()
        batcher = self.batcher
        self.metrics.queue_depth.set_function(lambda: batcher.queued)
        try:
            warmed = warm_plans(self.model, batcher.plan_sizes)
        except Exception as e:  # noqa: BLE001 - the golden check passed: serve, and plan on demand
            log(logger, logging.WARNING, "batch sizes not planned ahead", model=self.name, error=f"{type(e).__name__}: {e}")
            warmed = []
        self.state, self.reason = State.READY, "ready"
        self.metrics.ready.set(1)
        log(logger, logging.INFO, "model ready", model=self.name, version=self.version, device=self.device,
            seconds=round(time.monotonic() - t0, 3), batchable=self.batcher.batchable,
            planned_batch_sizes=",".join(map(str, warmed)))

    def _fail(self, reason: str) -> None:
        self.state, self.reason = State.FAILED, reason
        self.metrics.ready.set(0)
        log(logger, logging.WARNING, "model not ready", model=self.name, version=self.version, reason=reason)

    async def infer(self, feeds: Mapping[str, np.ndarray], timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """Validate (before queueing, so a bad request never reaches a batch), then batch and run."""
        if self.state is not State.READY or self.batcher is None or self.model is None:
            raise Unavailable(f"model {self.name} version {self.version} is not ready: {self.reason}")
        try:
            feeds = self.model.validate_inputs(feeds)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        for name, a in feeds.items():
            if a.ndim > 0 and a.shape[0] == 0:
                raise BadRequest(f"input {name!r}: batch dimension is 0; send at least one row")
        timeout = self.config.request_timeout_s if timeout_s is None else min(timeout_s, self.config.request_timeout_s)
        try:
            return await self.batcher.submit(feeds, deadline=time.monotonic() + timeout)
        except QueueFull as e:
            raise Overloaded(str(e), retry_after_s=1) from None
        except BatcherClosed as e:
            raise Unavailable(str(e), retry_after_s=5) from None
        except DeadlineExceeded:
            raise Timeout(f"model {self.name}: no result within the request deadline ({timeout:g} s)") from None
        except BatchComputeError as e:
            raise ComputeFailed(str(e)) from None

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


class ModelRegistry:
    """Served models by name and version; the newest version answers unversioned routes."""

    def __init__(self, config: ServingConfig, metrics: ServingMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._models: dict[str, dict[str, ServedModel]] = {}
        self.traces = RequestTraces(config.trace_file, config.trace_rate) if config.trace_file is not None else None

    def _add(self, served: ServedModel) -> ServedModel:
        versions = self._models.setdefault(served.name, {})
        if served.version in versions:
            raise ValueError(f"model {served.name} version {served.version} is given twice")
        versions[served.version] = served
        return served

    def add_source(self, source: ModelSource) -> ServedModel:
        return self._add(ServedModel(source.name, source.version, self.config, self.metrics.for_model(source.name),
                                     source=source, traces=self.traces))

    def add_model(self, model: ModelLike) -> ServedModel:
        return self._add(ServedModel(model.name, str(model.version), self.config,
                                     self.metrics.for_model(model.name), model=model, traces=self.traces))

    def all(self) -> list[ServedModel]:
        return [s for versions in self._models.values() for s in versions.values()]

    def get(self, name: str, version: str | None = None) -> ServedModel:
        versions = self._models.get(name)
        if not versions:
            raise NotFound(f"unknown model {name!r}; this server has {sorted(self._models)}")
        if version is None:
            return versions[max(versions, key=_version_key)]
        served = versions.get(version)
        if served is None:
            raise NotFound(f"model {name!r} has no version {version!r}; it has {sorted(versions, key=_version_key)}")
        return served

    @property
    def ready(self) -> bool:
        models = self.all()
        return bool(models) and all(s.ready for s in models)

    def not_ready_reasons(self) -> list[str]:
        return [f"model {s.name} version {s.version}: {s.reason}" for s in self.all() if not s.ready]

    async def load_all(self) -> None:
        """Load models one after another off the event loop (parallel loads would fight for cores)."""
        for served in self.all():
            if served.state is State.LOADING:
                await asyncio.to_thread(served.load)

    def close(self) -> None:
        for served in self.all():
            served.close()
        if self.traces is not None:
            self.traces.close()


def timeout_from_params(params: Mapping[str, Any]) -> float | None:
    """OIP request parameter `timeout` (microseconds, as Triton spells it) -> seconds."""
    t = params.get("timeout")
    if t is None:
        return None
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
        raise BadRequest(f"parameter timeout must be a positive number of microseconds, got {t!r}")
    return float(t) * 1e-6
