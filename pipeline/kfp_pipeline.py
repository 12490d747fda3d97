"""The Kubeflow (kfp v2) pipeline: thin components around kubetrt.pipeline.stages.

    ingest -> lower -> ParallelFor(targets) [ plan -> build -> verify(+publish) ] -> Collected -> deploy

GPU pinning inside the loop. The node selector must follow the loop item, and kfp-kubernetes
2.17 cannot take a loop item (or a field of it) directly: the compiled YAML references an input
that the loop's DAG does not define. It does accept a *task output* (add_node_selector_json with
a PipelineParameterChannel), so a tiny `plan` task turns the loop item into
{"nvidia.com/gpu.product": <product>} and an accelerator count (1 for GPU targets, 0 for host),
and build/verify read both from it. This keeps `targets` a runtime pipeline parameter (the
compile-time --target list is only its default) instead of a static per-GPU fan-out.
The accelerator type is the constant nvidia.com/gpu; the toleration for the usual
nvidia.com/gpu:NoSchedule taint is static (harmless on CPU nodes).

Components import kubetrt inside their bodies (they run in `image`, a pipeline parameter whose
default DEFAULT_IMAGE docker/pipeline.Dockerfile builds), install nothing at run time (packages_to_install is empty,
install_kfp_package=False), and so run unchanged under kfp.local.SubprocessRunner(use_venv=False).
"""
import contextlib
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, List, NamedTuple, Sequence

from kfp import dsl, kubernetes
from kfp.dsl import Artifact, Input, Model, Output

from kubetrt import __version__
from kubetrt.operators.names import GPU_RESOURCE, GPU_TAINT_EFFECT, GPU_TAINT_KEY

# The components' image: docker/pipeline.Dockerfile, tagged with the project's version as the
# operator, serving and builder images are. The pipeline's `image` parameter overrides it per run.
IMAGE_REPOSITORY = "ghcr.io/kubetrt/pipeline"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
PIPELINE_NAME = "kubetrt-optimize"
_COMPONENT = dict(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)


@dsl.component(**_COMPONENT)
def ingest_op(source: str, signature: str, s3_endpoint: str, savedmodel: Output[Artifact]) -> NamedTuple("Ingested", [("digest", str), ("name", str)]):  # type: ignore[valid-type]  # kfp reads the outputs from this call
    """Fetch and validate the SavedModel; returns its digest and the model name its URI implies."""
    import shutil
    import tempfile
    from collections import namedtuple

    from kubetrt.pipeline.sources import model_name_from_uri
    from kubetrt.pipeline.stages import ingest_stage

    with tempfile.TemporaryDirectory() as tmp:
        info = ingest_stage(source, tmp, signature, s3_endpoint=s3_endpoint or None)
        shutil.copytree(info.path, savedmodel.path)
    savedmodel.metadata["digest"] = info.digest
    Ingested = namedtuple("Ingested", ["digest", "name"])
    return Ingested(info.digest, model_name_from_uri(source))


@dsl.component(**_COMPONENT)
def lower_op(savedmodel: Input[Artifact], name: str, default_name: str, signature: str, version: str, store: str, s3_endpoint: str, package: Output[Model],
             calibration: str = "", calibration_method: str = "minmax", calibration_preprocess: str = "") -> str:
    """Lower to a model package (with the INT8 model when `calibration` names data) and publish it
    to the store; returns the model digest."""
    from kubetrt.pipeline.stages import lower_stage
    from kubetrt.pipeline.store import open_store

    lower_stage(savedmodel.path, package.path, name=name or default_name, signature=signature, version=version,
                calibration=calibration, calibration_method=calibration_method,
                calibration_preprocess=calibration_preprocess, s3_endpoint=s3_endpoint or None)
    digest = open_store(store, s3_endpoint=s3_endpoint or None).publish_package(package.path)
    package.metadata["model_digest"] = digest
    return digest


@dsl.component(**_COMPONENT)
def plan_op(target: str) -> NamedTuple("Plan", [("spec", str), ("node_selector", dict), ("gpus", int)]):  # type: ignore[valid-type]  # kfp reads the outputs from this call
    """Scheduling for one target: its node selector and GPU count (read by build and verify)."""
    from collections import namedtuple

    from kubetrt.pipeline.targets import plan_target

    plan = plan_target(target)
    Plan = namedtuple("Plan", ["spec", "node_selector", "gpus"])
    return Plan(
        plan["spec"], plan["node_selector"], 1 if plan["kind"] == "gpu" else 0
    )


@dsl.component(**_COMPONENT)
def build_op(package: Input[Model], target: str, store: str, s3_endpoint: str, engine: Output[Artifact]) -> NamedTuple("Build", [("key", str), ("reused", bool), ("target", str)]):  # type: ignore[valid-type]  # kfp reads the outputs from this call
    """Build the engine on this node, unless the store already has a verified one for its key."""
    import json
    from collections import namedtuple
    from pathlib import Path

    from kubetrt.pipeline.stages import build_stage
    from kubetrt.pipeline.store import open_store
    from kubetrt.runtime.package import open_package
    from kubetrt.runtime.target import parse_target

    built = build_stage(package.path, open_package(package.path), parse_target(target),
                        open_store(store, s3_endpoint=s3_endpoint or None), engine.path)
    Path(engine.path).mkdir(parents=True, exist_ok=True)
    if built.reused:
        (Path(engine.path) / "REUSED").write_text(built.key + "\n")
    engine.metadata.update(key=built.key, reused=built.reused, build=json.dumps(built.metadata, default=str))
    Build = namedtuple("Build", ["key", "reused", "target"])
    return Build(built.key, built.reused, json.dumps(built.target.to_json()))


@dsl.component(**_COMPONENT)
def verify_op(package: Input[Model], engine: Input[Artifact], target: str, key: str, reused: bool, store: str, s3_endpoint: str, report: Output[Artifact]) -> str:
    """Verify against TensorFlow's golden outputs and publish if it passes; returns the engine record."""
    import json
    from pathlib import Path

    from kubetrt.pipeline.stages import Built, engine_record, publish_stage, verify_stage
    from kubetrt.pipeline.store import model_digest, open_store
    from kubetrt.runtime.package import open_package
    from kubetrt.runtime.target import Target

    engine_store = open_store(store, s3_endpoint=s3_endpoint or None)
    resolved = Target.from_json(json.loads(target))
    manifest = open_package(package.path)
    digest = model_digest(manifest)
    built = Built(key, resolved, digest, None if reused else Path(engine.path), reused=reused)
    if reused:
        stored = engine_store.read_report(digest, key)
        if not stored or not stored.get("passed"):
            raise RuntimeError(f"engine {key} was reported reusable but the store has no passing report")
        Path(report.path).write_text(json.dumps(stored, indent=2))
        record = engine_record(engine_store, built, reused=True)
    else:
        result = verify_stage(package.path, manifest, engine.path, resolved)
        Path(report.path).write_text(json.dumps(result, indent=2))  # kept even when it fails
        record = publish_stage(engine_store, built, result)
    report.metadata.update(key=key, passed=True, summary=record.summary)
    return json.dumps(record.to_json())


@dsl.component(**_COMPONENT)
def deploy_op(engines: List[str], store: str, s3_endpoint: str, signature: str, deployment: Output[Artifact]) -> str:
    """Emit the ModelDeployment naming the verified engines (YAML artifact; returned as text too).

    The stored package's manifest gives the name, version and, for int8 engines, the calibration
    record the ModelDeployment must carry."""
    import json
    from pathlib import Path

    from kubetrt.pipeline.deploy import model_deployment, to_yaml
    from kubetrt.pipeline.store import open_store

    records = [json.loads(e) for e in engines]
    engine_store = open_store(store, s3_endpoint=s3_endpoint or None)
    digest = records[0]["model_digest"]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        from kubetrt.runtime.package import read_manifest

        manifest = read_manifest(engine_store.fetch_package(digest, Path(tmp) / "pkg"))
    resource = model_deployment(
        manifest.name, manifest.version, engine_store.package_uri(digest), records,
        store_uri=engine_store.uri, signature=signature, quantization=manifest.quantization,
    )
    text = to_yaml(resource)
    Path(deployment.path).write_text(text)
    return text


def _on_node(task: dsl.PipelineTask, plan: dsl.PipelineTask, image: Any) -> dsl.PipelineTask:
    """Pin a loop task to the target's GPU product (values from the plan task, see module doc)."""
    task.set_container_image(image)
    kubernetes.add_node_selector_json(task, plan.outputs["node_selector"])
    kubernetes.add_toleration(task, key=GPU_TAINT_KEY, operator="Exists", effect=GPU_TAINT_EFFECT)
    task.set_accelerator_type(GPU_RESOURCE)
    task.set_accelerator_limit(plan.outputs["gpus"])
    return task


def make_pipeline(default_targets: Sequence[str] = ("host",)) -> Any:
    """The pipeline function with `default_targets` (spec strings, validated now) as targets' default."""
    from kubetrt.runtime.target import parse_target

    defaults = [parse_target(t).spec() for t in default_targets]
    if not defaults:
        raise ValueError("no targets given; expected at least one, e.g. --target host")

    @dsl.pipeline(name=PIPELINE_NAME, description="SavedModel -> model package -> verified per-GPU engines -> ModelDeployment")
    def kubetrt_pipeline(
        source: str,
        store: str,
        targets: List[str] = defaults,
        image: str = DEFAULT_IMAGE,
        name: str = "",
        version: str = "1",
        signature: str = "serving_default",
        s3_endpoint: str = "",
        calibration: str = "",
        calibration_method: str = "minmax",
        calibration_preprocess: str = "",
    ) -> str:
        ingest = ingest_op(source=source, signature=signature, s3_endpoint=s3_endpoint).set_container_image(image)
        ingest.set_display_name("ingest")
        lower = lower_op(
            savedmodel=ingest.outputs["savedmodel"], name=name, default_name=ingest.outputs["name"], signature=signature, version=version,
            store=store, s3_endpoint=s3_endpoint, calibration=calibration, calibration_method=calibration_method,
            calibration_preprocess=calibration_preprocess,
        ).set_container_image(image)
        lower.set_display_name("lower")
        with dsl.ParallelFor(targets, name="targets") as target:
            plan = plan_op(target=target).set_container_image(image).set_display_name("plan")
            plan.set_caching_options(False)
            build = build_op(
                package=lower.outputs["package"], target=plan.outputs["spec"], store=store, s3_endpoint=s3_endpoint
            )
            _on_node(build.set_display_name("build").set_caching_options(False), plan, image)
            verify = verify_op(
                package=lower.outputs["package"], engine=build.outputs["engine"], target=build.outputs["target"],
                key=build.outputs["key"], reused=build.outputs["reused"], store=store, s3_endpoint=s3_endpoint,
            )
            _on_node(verify.set_display_name("verify").set_caching_options(False), plan, image)
        deploy = deploy_op(
            engines=dsl.Collected(verify.outputs["Output"]), store=store, s3_endpoint=s3_endpoint, signature=signature
        ).set_container_image(image)
        deploy.set_display_name("deploy").set_caching_options(False)
        return deploy.outputs["Output"]

    return kubetrt_pipeline


def compile_pipeline(out: str | os.PathLike[str], targets: Sequence[str] = ("host",)) -> Path:
    """Write the pipeline YAML (IR + kubernetes platform spec) for Kubeflow."""
    from kfp import compiler

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(make_pipeline(targets), str(out))
    return out


def run_local(
    source: str,
    store: str,
    targets: Sequence[str],
    pipeline_root: str | os.PathLike[str],
    *,
    name: str = "",
    version: str = "1",
    signature: str = "serving_default",
    s3_endpoint: str = "",
    calibration: str = "",
    calibration_method: str = "minmax",
    calibration_preprocess: str = "",
    verbose: bool = False,
) -> str:
    """Run the pipeline with kfp.local (subprocesses, this environment); returns the ModelDeployment YAML.

    kfp.local is chatty (every task's full log); unless `verbose`, its output goes to
    <pipeline_root>/kfp-local.log and only one progress line per finished task is shown.
    A failure raises RuntimeError carrying the failing task's last log lines. Targets and
    calibration are checked first (int8 targets need `calibration`): a bad request starts nothing.
    """
    from kfp import local

    from kubetrt.pipeline.stages import check_calibration_request
    from kubetrt.runtime.target import parse_target

    parsed = [parse_target(t) for t in targets]  # fail before starting anything
    check_calibration_request(parsed, calibration, calibration_method, calibration_preprocess)
    if calibration and "://" not in calibration:
        calibration = str(Path(calibration).expanduser().resolve())  # the tasks' working directory may differ
    specs = [t.spec() for t in parsed]
    root = Path(pipeline_root)
    root.mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    pipeline = make_pipeline(specs)
    kwargs = dict(source=source, store=store, targets=specs, name=name, version=version, signature=signature,
                  s3_endpoint=s3_endpoint, calibration=calibration, calibration_method=calibration_method,
                  calibration_preprocess=calibration_preprocess)
    if verbose:
        return str(pipeline(**kwargs).output)
    log_path = root / "kfp-local.log"
    with _captured_output(log_path) as lines:
        try:
            run = pipeline(**kwargs)
        except Exception as e:
            raise RuntimeError(f"kfp local run failed: {_failure_summary(lines)} (full log: {log_path})") from e
    return str(run.output)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_DONE = re.compile(r"Task '([^']+)' finished with status (\w+)")


@contextlib.contextmanager
def _captured_output(log_path: Path) -> Iterator[list[str]]:
    """Redirect fds 1 and 2 (kfp.local and its subprocesses) into a log; emit progress per task."""
    from kubetrt.telemetry import progress

    lines: list[str] = []
    show = progress.enabled()
    real_err = os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    read_fd, write_fd = os.pipe()

    def pump() -> None:
        with open(log_path, "w") as log, os.fdopen(read_fd, "r", errors="replace") as src:
            for raw in src:
                log.write(raw)
                line = _ANSI.sub("", raw.rstrip("\n"))
                lines.append(line)
                del lines[:-200]
                m = _TASK_DONE.search(line)
                if m and show:
                    os.write(real_err, f"[kubetrt] kfp task {m[1]}: {m[2].lower()}\n".encode())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield lines
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved,):
            os.close(fd)
        reader.join(timeout=10)
        os.close(real_err)


def _failure_summary(lines: list[str]) -> str:
    """The most telling line of a failed run: the last exception message from a task."""
    for line in reversed(lines):
        text = line.strip()
        if re.match(r"^[\w.]*(Error|Exception)\b.*:", text) and "finished with status" not in text:
            return text
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
