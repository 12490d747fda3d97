"""End to end, as processes: SavedModel -> pipeline -> ModelDeployment -> the real kopf operator ->
its build Job run as a real `kubetrt build` process -> its serving Deployment run as a real
`kubetrt serve` process -> Open Inference Protocol requests from tritonclient.

The cluster is the emulated API server of tests/operators plus tests/e2e: the Job/Deployment
controllers are played by tests/e2e/controllers.py and the kubelet by tests/e2e/kubelet.py, which
runs each container exactly as the operator generated it (command, env, hostPath/emptyDir mounts,
/dev/termination-log) in a private mount namespace. The build result the operator reads is the
one the build process really wrote.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kubetrt.operators import names, objects
from kubetrt.runtime.accuracy import TOLERANCES
from kubetrt.pipeline.store import open_store
from kubetrt.runtime.package import load_golden, open_package
from operator_testlib import CONFIG, NS, eventually
from test_operator_integration import (MD, TEST_AGENT, assert_rbac_allows_every_operator_request, condition,
                                       edit_model_deployment, objs)

import kubelet
from batching_probe import batch_sizes, burst
from controllers import (SERVING_URL, finish_build_pod, mark_deployment_ready, report_pod,
                         run_build_job, start_build_pod, start_serving_pod, wait_for_build_job, wait_for_deployment)

HOST_FP32 = TOLERANCES[("fp32", "host")]  # the host target's tolerance (atol = rtol), as verification uses
BUILD_TIMEOUT = 180.0
# The serving pods listen on the host's 8080 (kubelet.py shares the host network), so this module's
# tests run on one worker when the suite runs in parallel (pytest -n with --dist loadgroup).
pytestmark = pytest.mark.xdist_group("host-port-8080")


# ----------------------------------------------------------------------------- the model, once per module
@dataclass
class PipelineModel:
    """The example CNN through the in-process pipeline into a local store, with TensorFlow's answers."""

    savedmodel: Path
    store: Path
    digest: str
    key: str
    deployment: dict[str, Any]  # the ModelDeployment the pipeline's deploy step wrote (file:// URIs)
    golden: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]  # the package's golden batches
    tensorflow: dict[int, dict[str, np.ndarray]]  # TF's outputs for those inputs, computed here

    @property
    def name(self) -> str:
        return self.deployment["metadata"]["name"]

    @property
    def digest_dir(self) -> Path:
        return self.store / self.digest

    @property
    def engine_dir(self) -> Path:
        return self.store / self.digest / self.key

    def remove_engine(self) -> None:
        """Take the engine (and any staging leftovers) out of the store: the next build must build it."""
        shutil.rmtree(self.engine_dir, ignore_errors=True)
        for leftover in self.digest_dir.glob(f".{self.key}.*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def model_deployment(self, **spec: Any) -> dict[str, Any]:
        md = copy.deepcopy(self.deployment)
        md["metadata"]["namespace"] = NS
        md["spec"].update(copy.deepcopy(spec))
        return md

    def check_engine(self, tmp: Path) -> dict[str, Any]:
        """The stored engine is complete, digest-checked and passed verification."""
        store = open_store(self.store)
        assert store.list_engines(self.digest) == [self.key]
        report = store.fetch_engine(self.digest, self.key, tmp / f"engine-{time.monotonic_ns()}")  # checks digests
        assert report["passed"] and report["key"] == self.key, report.get("summary")
        return report


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> PipelineModel:
    from kubetrt.pipeline.demo import build_example_savedmodel
    from kubetrt.pipeline.ingest import tensorflow
    from kubetrt.pipeline.stages import run_pipeline

    root = tmp_path_factory.mktemp("e2e")
    savedmodel = build_example_savedmodel(root / "example-cnn")
    result = run_pipeline(str(savedmodel), str(root / "store"), ["host"], root / "work")
    (engine,) = result.engines
    package = result.package_dir
    golden = load_golden(package, open_package(package))
    tf = tensorflow()
    serving_default = tf.saved_model.load(str(savedmodel)).signatures["serving_default"]
    reference = {batch: {k: v.numpy() for k, v in serving_default(**{n: tf.constant(x) for n, x in ins.items()}).items()}
                 for batch, (ins, _) in golden.items()}
    m = PipelineModel(savedmodel, root / "store", result.model_digest, engine.key, result.deployment, golden, reference)
    assert m.deployment["spec"]["store"]["uri"] == f"file://{m.store}"
    m.remove_engine()  # so the operator's build Job must really build it
    return m


# ----------------------------------------------------------------------------- helpers
def serve_arg(dep: dict[str, Any], flag: str) -> str:
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    return cmd[cmd.index(flag) + 1]


def engine_builds(api: Any) -> dict[str, dict[str, Any]]:
    return objs(api, "enginebuilds")


def triton() -> Any:
    import tritonclient.http

    return tritonclient.http


def infer(model_name: str, version: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
          ) -> dict[str, np.ndarray]:
    http = triton()
    client = http.InferenceServerClient(SERVING_URL.removeprefix("http://"), network_timeout=60)
    feeds = []
    for name, x in inputs.items():
        feed = http.InferInput(name, list(x.shape), "FP32")
        feed.set_data_from_numpy(np.ascontiguousarray(x, dtype=np.float32), binary_data=True)
        feeds.append(feed)
    wanted = [http.InferRequestedOutput(o, binary_data=True) for o in outputs] if outputs else None
    result = client.infer(model_name, feeds, model_version=version, outputs=wanted)
    return {o: result.as_numpy(o) for o in outputs or []}


def assert_answers_like_tensorflow(model: PipelineModel, served_name: str, version: str) -> None:
    """Every golden batch, over binary OIP, equals TensorFlow's outputs at the host fp32 tolerance."""
    for batch, (inputs, _) in sorted(model.golden.items()):
        want = model.tensorflow[batch]
        got = infer(served_name, version, inputs, sorted(want))
        for name, ref in want.items():
            np.testing.assert_allclose(got[name], ref, rtol=HOST_FP32, atol=HOST_FP32,
                                       err_msg=f"batch {batch}, output {name}")


async def quiet(api: Any, seconds: float = 1.0, timeout: float = 20.0) -> None:
    """Wait until the operator has written nothing to the API for `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def writes() -> int:
        return sum(1 for r in list(api) if r.method.value.upper() in ("POST", "PUT", "PATCH", "DELETE")
                   and r.headers.get("User-Agent") != TEST_AGENT)

    last, since = writes(), loop.time()
    while loop.time() < deadline:
        await asyncio.sleep(0.1)
        now = writes()
        if now != last:
            last, since = now, loop.time()
        elif loop.time() - since >= seconds:
            return
    raise AssertionError(f"the operator kept writing for {timeout}s")


VOLATILE = {"resourceVersion", "managedFields", "creationTimestamp", "lastTransitionTime", "startTime",
            "completionTime", "lastUpdateTime"}


def without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    return value


def snapshot(api: Any) -> dict[str, dict[str, Any]]:
    return {plural: without_volatile(objs(api, plural))
            for plural in ("deployments", "services", "enginebuilds", "jobs", "modeldeployments")}


# ----------------------------------------------------------------------------- the flow
async def test_the_pipelines_model_is_built_by_the_operators_job_and_served(
        api: Any, client: Any, operator: Any, model: PipelineModel, tmp_path: Path) -> None:
    md = model.model_deployment(batching={"maxBatchSize": 2, "maxQueueDelayMicroseconds": 1_000_000})
    name, version = md["spec"]["model"]["name"], md["spec"]["model"]["version"]
    assert not model.engine_dir.exists()
    await asyncio.to_thread(client.create, md)

    # The EngineBuild's Job runs `kubetrt build` for the pipeline's target; the build really builds.
    job = await wait_for_build_job(api)
    build = job["spec"]["template"]["spec"]["containers"][0]
    assert build["image"] == CONFIG.builder_image and build["command"][:2] == ["kubetrt", "build"]
    pod, container = await start_build_pod(client, job)
    await eventually(lambda: next(iter(engine_builds(api).values()))["status"]["phase"] == "Running")
    result = await asyncio.to_thread(container.wait, BUILD_TIMEOUT)
    assert result.exit_code == 0, result.describe()
    written = json.loads(result.message)
    assert (written["engineKey"], written["verified"], written["reused"]) == (model.key, True, False)
    await finish_build_pod(client, job, pod, result)
    eb = await eventually(lambda: (e := next(iter(engine_builds(api).values())))["status"]["phase"] == "Succeeded" and e,
                          describe=lambda: [e.get("status") for e in engine_builds(api).values()])
    assert eb["status"]["verified"] is True and eb["status"]["engineKey"] == model.key
    assert eb["status"]["report"]["summary"] == written["report"]["summary"]
    model.check_engine(tmp_path)

    # The serving Deployment serves exactly that engine under the ModelDeployment's name and version.
    dep_name = objects.deployment_name(md["metadata"]["name"], md["spec"]["targets"][0]["name"])
    dep = await wait_for_deployment(api, dep_name)
    serving = dep["spec"]["template"]["spec"]["containers"][0]
    assert serving["image"] == CONFIG.serving_image
    assert serve_arg(dep, "--engine-key") == model.key
    pod = await start_serving_pod(dep)
    try:
        http = triton().InferenceServerClient(SERVING_URL.removeprefix("http://"))
        assert http.is_server_ready() and http.is_model_ready(name, version)
        meta = http.get_model_metadata(name, version)
        assert (meta["name"], meta["versions"]) == (name, [version])
        assert_answers_like_tensorflow(model, name, version)

        # spec.batching reached the batcher: queued one-row requests merge, never beyond maxBatchSize.
        before = batch_sizes(SERVING_URL, name)
        image = model.golden[min(model.golden)][0]["image"][:1]
        await asyncio.to_thread(burst, lambda rows: infer(name, version, {"image": np.repeat(image, rows, axis=0)}), 8)
        count, rows, buckets = batch_sizes(SERVING_URL, name)
        small = {le: c - before[2][le] for le, c in buckets.items()}  # the 512-row blocker is above 256
        assert rows - before[1] == 512 + 8 and count - before[0] == small[256] + 1
        assert small[2] == small[256], f"every batch of queued requests holds at most 2 rows: {small}"
        assert small[1] < small[256], f"queued requests were batched together: {small}"

        # The Deployment controller reports the pod ready: the ModelDeployment is Ready, with its endpoint.
        await mark_deployment_ready(client, api, dep_name)
        ready = await eventually(lambda: (c := condition(api, md["metadata"]["name"], "Ready")) and c["status"] == "True"
                                 and c, describe=lambda: objs(api, "modeldeployments")[md["metadata"]["name"]].get("status"))
        assert ready["reason"] == "Serving"
        status = objs(api, "modeldeployments")[md["metadata"]["name"]]["status"]
        svc = objects.service_name(md["metadata"]["name"])
        assert status["endpoint"] == f"http://{svc}.{NS}.svc.{CONFIG.cluster_domain}:{names.SERVING_PORT}"
        assert status["modelURL"] == f"{status['endpoint']}/v2/models/{name}/versions/{version}"
        (target,) = status["targets"]
        assert (target["engineKey"], target["readyReplicas"], target["buildPhase"]) == (model.key, 1, "Succeeded")
    finally:
        stopped = await asyncio.to_thread(pod.stop)
    assert stopped.exit_code == 0, f"SIGTERM is a graceful shutdown: {stopped.describe()}"
    assert_rbac_allows_every_operator_request(api)


async def test_a_new_model_version_rolls_out_to_a_new_pod(
        api: Any, client: Any, operator: Any, model: PipelineModel) -> None:
    md = model.model_deployment()
    name = md["spec"]["model"]["name"]
    await asyncio.to_thread(client.create, md)
    first = await run_build_job(client, api, BUILD_TIMEOUT)
    assert first.exit_code == 0, first.describe()
    dep_name = objects.deployment_name(md["metadata"]["name"], md["spec"]["targets"][0]["name"])
    dep = await wait_for_deployment(api, dep_name)
    assert serve_arg(dep, "--model-version") == "1"
    old = await start_serving_pod(dep)
    try:
        assert triton().InferenceServerClient("127.0.0.1:8080").get_model_metadata(name)["versions"] == ["1"]
        await mark_deployment_ready(client, api, dep_name)

        # A new version is a new engine identity: a new EngineBuild, whose Job finds the verified
        # engine in the store (same model digest and target) and reuses it.
        await edit_model_deployment(client, lambda live: live["spec"]["model"].update(version="2"), md["metadata"]["name"])
        job = await wait_for_build_job(api)
        await quiet(api)
        pending = objs(api, "deployments")[dep_name]
        assert (serve_arg(pending, "--model-version"), pending["metadata"]["annotations"][names.ANN_ENGINE_BUILD]) \
            == ("1", dep["metadata"]["annotations"][names.ANN_ENGINE_BUILD]), \
            "until version 2's build verified, the pods keep serving version 1 as version 1"
        second = await run_build_job(client, api, BUILD_TIMEOUT)
        assert second.exit_code == 0, second.describe()
        assert json.loads(second.message)["engineKey"] == model.key and json.loads(second.message)["reused"] is True
        new = await wait_for_deployment(api, dep_name, lambda d: serve_arg(d, "--model-version") == "2" and
                                        d["metadata"]["annotations"][names.ANN_ENGINE_BUILD] == job["metadata"]["name"])
        assert new["metadata"]["generation"] > dep["metadata"]["generation"]
        assert serve_arg(new, "--engine-key") == model.key
    finally:
        await asyncio.to_thread(old.stop)  # the old pod goes first: pods share the host's port here

    pod = await start_serving_pod(new)
    try:
        http = triton().InferenceServerClient("127.0.0.1:8080")
        assert http.get_model_metadata(name)["versions"] == ["2"]
        assert_answers_like_tensorflow(model, name, "2")
        assert not http.is_model_ready(name, "1"), "only the new version is served"
        await mark_deployment_ready(client, api, dep_name)
        md_name = md["metadata"]["name"]
        await eventually(lambda: (s := objs(api, "modeldeployments")[md_name]["status"])["observedGeneration"] == 2
                         and (condition(api, md_name, "Ready") or {}).get("status") == "True",
                         describe=lambda: objs(api, "modeldeployments")[md_name]["status"])
        assert objs(api, "modeldeployments")[md_name]["status"]["modelURL"].endswith(f"/v2/models/{name}/versions/2")
        await eventually(lambda: len(engine_builds(api)) == 1, describe=lambda: list(engine_builds(api)))
    finally:
        await asyncio.to_thread(pod.stop)


async def test_deleting_the_model_deployment_removes_everything_it_created(
        api: Any, client: Any, operator: Any, model: PipelineModel, tmp_path: Path) -> None:
    md = model.model_deployment()
    await asyncio.to_thread(client.create, md)
    result = await run_build_job(client, api, BUILD_TIMEOUT)
    assert result.exit_code == 0, result.describe()
    await wait_for_deployment(api, objects.deployment_name(md["metadata"]["name"], md["spec"]["targets"][0]["name"]))
    plurals = ("modeldeployments", "enginebuilds", "jobs", "pods", "deployments", "services")
    assert all(objs(api, p) for p in plurals), {p: list(objs(api, p)) for p in plurals}

    await asyncio.to_thread(client.delete, *MD, NS, md["metadata"]["name"])
    await eventually(lambda: not any(objs(api, p) for p in plurals),
                     describe=lambda: {p: list(objs(api, p)) for p in plurals})
    model.check_engine(tmp_path)  # the store is not the ModelDeployment's: the verified engine stays
    assert_rbac_allows_every_operator_request(api)


# ----------------------------------------------------------------------------- faults
def kill_while_publishing(container: kubelet.Container, digest_dir: Path, key: str, timeout: float) -> list[str]:
    """SIGKILL the build once its staging directory holds files (the engine is being published).

    Returns the staging directory's entries at the kill, or [] if the build ended first."""
    deadline = time.monotonic() + timeout
    while container.running() and time.monotonic() < deadline:
        staging = [n for n in (os.listdir(digest_dir) if digest_dir.is_dir() else [])
                   if n.startswith(f".{key}.") and n.endswith(".partial")]
        if not staging:
            time.sleep(0.0005)
            continue
        try:
            inside = sorted(os.listdir(digest_dir / staging[0]))
        except FileNotFoundError:
            continue  # renamed into place just now
        if inside:
            os.kill(container.pid, signal.SIGKILL)
            return inside
    return []


def assert_no_partial_engine(model: PipelineModel, tmp: Path) -> None:
    """Readers see no engine, or a complete verified one: never a half-published directory."""
    visible = sorted(n for n in os.listdir(model.digest_dir) if not n.startswith("."))
    assert set(visible) <= {"package", model.key}, visible
    store = open_store(model.store)
    if model.engine_dir.exists():
        model.check_engine(tmp)
    else:
        assert store.list_engines(model.digest) == [] and not store.has_engine(model.digest, model.key)


async def test_a_build_killed_while_publishing_leaves_no_partial_engine_and_the_retry_publishes(
        api: Any, client: Any, operator: Any, model: PipelineModel, tmp_path: Path) -> None:
    model.remove_engine()
    md = model.model_deployment()
    await asyncio.to_thread(client.create, md)
    job = await wait_for_build_job(api)
    for attempt in range(5):
        pod, container = await start_build_pod(client, job)
        at_kill = await asyncio.to_thread(kill_while_publishing, container, model.digest_dir, model.key, BUILD_TIMEOUT)
        killed = await asyncio.to_thread(container.wait, 30)
        assert_no_partial_engine(model, tmp_path)
        if at_kill and killed.signal == signal.SIGKILL and not model.engine_dir.exists():
            break  # killed mid-publish: staging had files, nothing was renamed into place
        model.remove_engine()  # the build finished (or was killed elsewhere) first: try again
    else:
        pytest.fail("no SIGKILL landed while the engine was being published in 5 attempts")
    assert (killed.exit_code, killed.signal) == (137, signal.SIGKILL)
    assert list(model.digest_dir.glob(f".{model.key}.*.partial")), "the killed publish left only hidden staging"
    # The kubelet reports the killed pod: empty termination log, so the log tail (FallbackToLogsOnError;
    # the build may have printed nothing yet when the kill landed).
    assert killed.message in killed.log
    await report_pod(client, pod, killed)
    await asyncio.sleep(1.1)  # finishedAt has one-second resolution: the retry's pod terminates later
    assert next(iter(engine_builds(api).values()))["status"]["phase"] != "Failed", "the Job still has retries"

    # The Job controller's retry: a new pod of the same Job publishes the engine.
    pod, container = await start_build_pod(client, job)
    retry = await asyncio.to_thread(container.wait, BUILD_TIMEOUT)
    assert retry.exit_code == 0, retry.describe()
    assert json.loads(retry.message)["engineKey"] == model.key and json.loads(retry.message)["reused"] is False
    await finish_build_pod(client, job, pod, retry)
    eb = await eventually(lambda: (e := next(iter(engine_builds(api).values())))["status"]["phase"] == "Succeeded" and e,
                          describe=lambda: [e.get("status") for e in engine_builds(api).values()])
    assert eb["status"]["engineKey"] == model.key
    model.check_engine(tmp_path)


async def test_an_operator_restarted_mid_rollout_converges_to_the_same_objects(
        api: Any, client: Any, restartable_operator: Any, model: PipelineModel) -> None:
    md = model.model_deployment()
    md_name = md["metadata"]["name"]
    dep_name = objects.deployment_name(md_name, md["spec"]["targets"][0]["name"])
    await asyncio.to_thread(client.create, md)
    assert (await run_build_job(client, api, BUILD_TIMEOUT)).exit_code == 0
    await wait_for_deployment(api, dep_name)
    await mark_deployment_ready(client, api, dep_name)
    await edit_model_deployment(client, lambda live: live["spec"]["model"].update(version="2"), md_name)
    job = await wait_for_build_job(api)  # mid-rollout: version 2's build is pending, pods serve version 1

    await quiet(api)
    before = snapshot(api)
    assert len(before["enginebuilds"]) == 2 and job["metadata"]["name"] in before["enginebuilds"]
    await restartable_operator.stop()
    await restartable_operator.start()
    await quiet(api)
    assert snapshot(api) == before, "a restarted operator re-creates, replaces or rewrites nothing that was converged"

    # Down again while the build finishes; once back, the operator completes the rollout.
    await restartable_operator.stop()
    pod, container = await start_build_pod(client, job)
    result = await asyncio.to_thread(container.wait, BUILD_TIMEOUT)
    assert result.exit_code == 0, result.describe()
    await finish_build_pod(client, job, pod, result)
    await restartable_operator.start()
    dep = await wait_for_deployment(api, dep_name, lambda d: serve_arg(d, "--model-version") == "2" and
                                    d["metadata"]["annotations"][names.ANN_ENGINE_BUILD] == job["metadata"]["name"])
    await eventually(lambda: list(engine_builds(api)) == [job["metadata"]["name"]],
                     describe=lambda: list(engine_builds(api)))
    assert before["deployments"][dep_name]["metadata"]["uid"] == dep["metadata"]["uid"], "updated, not re-created"
    assert_rbac_allows_every_operator_request(api)
