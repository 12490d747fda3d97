"""End to end with real images under podman (scripts/e2e-containers.sh; `pytest -m containers`).

SavedModel -> the pipeline in process (local store; the host engine it built is removed again) ->
the operator's own objects (kubetrt.operators.objects, called as operators/reconcile.py calls
them) -> the EngineBuild Job's pod run from the builder image -> the EngineBuild status the
operator derives from it -> the serving Deployment played from the serving image -> tritonclient
(binary and JSON) and TF Serving REST requests, compared with TensorFlow's own outputs. Then a
Deployment written as a user would (read-only root, no HOME, no emptyDir) serving a package
from a hostPath. Nothing here writes a pod's command line: pods run what the objects say.
"""
from __future__ import annotations

import copy
import datetime
import json
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pytest

from kubetrt.operators import names, objects, status
from kubetrt.operators.objects import OperatorConfig
from kubetrt.pipeline.store import open_store
from kubetrt.runtime.accuracy import TOLERANCES
from podman_pods import (BUILDER_IMAGE, E2E_LABEL, IMAGE_UID, OPERATOR_IMAGE, SERVING_IMAGE, SHM_SIDECAR, PodError, Played,
                         assert_sidecar_infers_through_shared_memory, inspect, kube_play, logs, podman, run_pod, say,
                         wait_http_ready)
from downward_api import quantity, resource_field

if TYPE_CHECKING:
    from conftest import PipelineModel

pytestmark = pytest.mark.containers

CONFIG = OperatorConfig(serving_image=SERVING_IMAGE, builder_image=BUILDER_IMAGE)
HOST_FP32 = TOLERANCES[("fp32", "host")]  # atol = rtol, as verification of host fp32 engines uses
LIMITS = {"cpu": "1", "memory": "2Gi"}  # what a user sets on the CPU target (spec.targets[].resources)
NUMBA_FALLBACK = "numba cache fallback"  # runtime/kernels/jit.py's one log line
USER_PORT = 8090


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            pytest.fail(f"port {port} is taken on this machine ({e}); the pods use the host network", pytrace=False)


# ----------------------------------------------------------------------------- operator objects
@dataclass
class Operator:
    md: dict[str, Any]
    spec: dict[str, Any]
    target: dict[str, Any]
    engine_build: dict[str, Any]
    job: dict[str, Any]


@pytest.fixture(scope="module")
def operator(model: PipelineModel) -> Operator:
    md = model.model_deployment()
    md["metadata"].setdefault("namespace", "default")
    md["metadata"]["uid"] = "00000000-0000-0000-0000-00000000e2e0"
    assert len(md["spec"]["targets"]) == 1 and md["spec"]["targets"][0].get("cpu"), md["spec"]["targets"]
    md["spec"]["targets"][0]["resources"] = {"limits": dict(LIMITS)}
    md["spec"].update(sharedMemory={"sizeLimit": "64Mi"}, sidecars=[SHM_SIDECAR], tracing={"rate": 1})
    spec = objects.normalized_spec(md)
    assert objects.validate_spec(spec) == []
    target = objects.resolve_target(spec, spec["targets"][0])
    eb = objects.engine_build(md, spec, target, CONFIG)
    job = objects.build_job(eb, CONFIG)
    return Operator(md, spec, target, eb, job)


# ----------------------------------------------------------------------------- the EngineBuild Job
@dataclass
class Build:
    exit_code: int
    message: str  # the termination message, as the kubelet reports it
    log: str
    container: dict[str, Any]  # podman inspect
    engine_build: dict[str, Any]  # with the status the operator derives from Job + pod
    seconds: float


@pytest.fixture(scope="module")
def build(model: PipelineModel, operator: Operator) -> Build:
    job = operator.job
    say(f"running the EngineBuild Job {job['metadata']['name']} from {BUILDER_IMAGE} (podman run from its pod template)")
    start = time.monotonic()
    pod = run_pod(job, f"{job['metadata']['name'][:50]}-e2e")
    try:
        code = pod.wait(timeout=600)
        seconds = time.monotonic() - start
        message = pod.termination_message(code)
        info, log = inspect(pod.name), logs(pod.name)
    finally:
        pod.remove()
    finished = _now()
    job_seen = copy.deepcopy(job)
    job_seen["status"] = ({"succeeded": 1, "startTime": finished, "completionTime": finished,
                           "conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": finished}]}
                          if code == 0 else
                          {"failed": 1, "startTime": finished,
                           "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                           "lastTransitionTime": finished}]})
    pods = [{"status": {"containerStatuses": [{"name": c["name"], "state": {"terminated": {
        "exitCode": code, "message": message, "finishedAt": finished}}}
        for c in job["spec"]["template"]["spec"]["containers"]]}}]
    eb = copy.deepcopy(operator.engine_build)
    eb["status"] = status.engine_build_status(eb, job_seen, pods)
    say(f"EngineBuild Job exited {code} in {seconds:.1f}s; status {eb['status'].get('phase')}, "
        f"engine {eb['status'].get('engineKey')}")
    return Build(code, message, log, info, eb, seconds)


def test_engine_build_job_builds_verifies_and_publishes(model: PipelineModel, build: Build, tmp_path: Path) -> None:
    assert build.exit_code == 0, f"build Job failed ({build.exit_code}); log tail:\n{build.log[-4000:]}"
    result = json.loads(build.message)  # the JSON the build wrote to its terminationMessagePath
    assert result["verified"] is True and result["engineKey"] == model.key and result["reused"] is False, result
    st = build.engine_build["status"]
    assert (st["phase"], st["verified"], st["engineKey"]) == ("Succeeded", True, model.key), st
    store = open_store(model.store)
    assert store.list_engines(model.digest) == [model.key]
    report = store.fetch_engine(model.digest, model.key, tmp_path / "engine")  # digest-checks every file
    assert report["passed"], report.get("summary")


def test_engine_build_job_runs_as_generated(operator: Operator, build: Build) -> None:
    container = operator.job["spec"]["template"]["spec"]["containers"][0]
    pod_sc = operator.job["spec"]["template"]["spec"]["securityContext"]
    cfg, host = build.container["Config"], build.container["HostConfig"]
    assert cfg["User"] == f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}" and pod_sc["runAsUser"] != 0
    assert host["ReadonlyRootfs"] is container["securityContext"]["readOnlyRootFilesystem"] is True
    assert cfg["Image"].endswith(BUILDER_IMAGE.split("/", 1)[1])


# ----------------------------------------------------------------------------- the serving Deployment
@dataclass
class Serving:
    deployment: dict[str, Any]
    played: Played
    container: str
    url: str
    model_name: str
    model_version: str


@pytest.fixture(scope="module")
def serving(model: PipelineModel, operator: Operator, build: Build) -> Iterator[Serving]:
    if build.exit_code != 0 or build.engine_build["status"].get("phase") != "Succeeded":
        pytest.fail(f"no verified engine to serve: {build.engine_build['status']}", pytrace=False)
    dep = objects.serving_deployment(operator.md, operator.spec, operator.target, build.engine_build, CONFIG)
    _port_free(names.SERVING_PORT)
    _port_free(names.SERVING_GRPC_PORT)
    say(f"playing the serving Deployment {dep['metadata']['name']} from {SERVING_IMAGE} (podman kube play)")
    played = kube_play(dep, model.root)
    try:
        url = f"http://127.0.0.1:{names.SERVING_PORT}"
        seconds = wait_http_ready(url + "/v2/health/ready", played.containers["serving"])
        say(f"serving pod ready in {seconds:.1f}s")
        yield Serving(dep, played, played.containers["serving"], url, operator.spec["model"]["name"],
                      str(operator.spec["model"]["version"]))
    finally:
        played.down()


def test_serving_answers_like_tensorflow_tritonclient(model: PipelineModel, serving: Serving) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(serving.url.removeprefix("http://"), network_timeout=60)
    assert client.is_server_ready() and client.is_model_ready(serving.model_name, serving.model_version)
    for binary in (True, False):
        feeds = []
        for name, x in model.inputs.items():
            feed = triton.InferInput(name, list(x.shape), "FP32")
            feed.set_data_from_numpy(x, binary_data=binary)
            feeds.append(feed)
        wanted = [triton.InferRequestedOutput(o, binary_data=binary) for o in sorted(model.tensorflow)]
        result = client.infer(serving.model_name, feeds, model_version=serving.model_version, outputs=wanted)
        response = result.get_response()
        for name, ref in sorted(model.tensorflow.items()):
            got = result.as_numpy(name)
            err = float(np.max(np.abs(got.astype(np.float64) - ref)))
            print(f"tritonclient ({'binary' if binary else 'JSON'}): model {response['model_name']} version "
                  f"{response.get('model_version')} output {name} shape {list(got.shape)} "
                  f"max abs error vs TensorFlow {err:.2e} (tolerance {HOST_FP32:g})", flush=True)
            assert response["model_name"] == serving.model_name
            np.testing.assert_allclose(got, ref, rtol=HOST_FP32, atol=HOST_FP32, err_msg=f"output {name}")


def test_serving_answers_like_tensorflow_tritonclient_grpc(model: PipelineModel, serving: Serving) -> None:
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{names.SERVING_GRPC_PORT}")
    assert client.is_server_ready() and client.is_model_ready(serving.model_name, serving.model_version)
    feeds = []
    for name, x in model.inputs.items():
        feed = triton.InferInput(name, list(x.shape), "FP32")
        feed.set_data_from_numpy(x)
        feeds.append(feed)
    unary = client.infer(serving.model_name, feeds, model_version=serving.model_version, client_timeout=60)
    answered: list[Any] = []
    done = threading.Event()
    def on_answer(result: Any, error: Any) -> None:
        answered.append(error or result)
        done.set()

    client.start_stream(callback=on_answer)
    try:
        client.async_stream_infer(serving.model_name, feeds, model_version=serving.model_version)
        assert done.wait(60), "no answer on the stream"
    finally:
        client.stop_stream()
        client.close()
    (streamed,) = answered
    assert not isinstance(streamed, Exception), streamed
    for how, result in (("gRPC", unary), ("gRPC stream", streamed)):
        for name, ref in sorted(model.tensorflow.items()):
            got = result.as_numpy(name)
            err = float(np.max(np.abs(got.astype(np.float64) - ref)))
            print(f"tritonclient ({how}): output {name} shape {list(got.shape)} max abs error vs TensorFlow {err:.2e} "
                  f"(tolerance {HOST_FP32:g})", flush=True)
            np.testing.assert_allclose(got, ref, rtol=HOST_FP32, atol=HOST_FP32, err_msg=f"output {name} ({how})")


def test_serving_image_answers_grpc_reflection_to_grpcurl(serving: Serving) -> None:
    repo = Path(__file__).resolve().parents[2]
    grpcurl = subprocess.run(["bash", str(repo / "scripts" / "get-go-tool.sh"), "grpcurl"], capture_output=True, text=True,
                             check=True, timeout=900).stdout.strip()
    target = f"127.0.0.1:{names.SERVING_GRPC_PORT}"
    listed = subprocess.run([grpcurl, "-plaintext", "-max-time", "30", target, "list"], capture_output=True, text=True, timeout=60)
    print(f"grpcurl list: {listed.stdout.split()}", flush=True)
    assert listed.returncode == 0, listed.stderr
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= set(listed.stdout.split())
    metadata = subprocess.run([grpcurl, "-plaintext", "-max-time", "30", "-d", json.dumps({"name": serving.model_name}), target,
                               "inference.GRPCInferenceService/ModelMetadata"], capture_output=True, text=True, timeout=60)
    assert metadata.returncode == 0 and json.loads(metadata.stdout)["name"] == serving.model_name, metadata.stderr


def test_serving_answers_like_tensorflow_tf_serving_rest(model: PipelineModel, serving: Serving) -> None:
    (name, x), = model.inputs.items()
    body = json.dumps({"instances": x.tolist()}).encode()
    req = urllib.request.Request(f"{serving.url}/v1/models/{serving.model_name}:predict", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        predictions = np.asarray(json.loads(resp.read())["predictions"], dtype=np.float64)
    (out, ref), = model.tensorflow.items()
    print(f"TF Serving REST: {serving.model_name}:predict {out} shape {list(predictions.shape)} "
          f"max abs error vs TensorFlow {float(np.max(np.abs(predictions - ref))):.2e}", flush=True)
    np.testing.assert_allclose(predictions, ref, rtol=HOST_FP32, atol=HOST_FP32)


def test_a_sidecar_infers_through_the_pods_shared_memory(model: PipelineModel, serving: Serving) -> None:
    """spec.sharedMemory and spec.sidecars as the operator generates them: a client in the sidecar
    container puts the input in the pod's /dev/shm, the server reads it there and writes the output
    there, and the sidecar reads TensorFlow's answer back from it."""
    assert_sidecar_infers_through_shared_memory(serving.played.containers[SHM_SIDECAR["name"]], serving.url,
                                                serving.model_name, serving.model_version, model.inputs,
                                                model.tensorflow, HOST_FP32, names.SHARED_MEMORY_PATH)


def test_serving_pod_traces_calls_into_its_log(model: PipelineModel, serving: Serving) -> None:
    """spec.tracing as the operator generates it: each call (rate 1) is a JSON line of its five
    stamps on the serving container's standard output, which the container's log shows."""
    def traces() -> list[dict[str, Any]]:
        return [json.loads(line) for line in logs(serving.container).splitlines() if line.startswith('{"id"')]

    before = len(traces())
    (name, x), = model.inputs.items()
    body = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
    req = urllib.request.Request(f"{serving.url}/v2/models/{serving.model_name}/infer", data=body.encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
    deadline = time.monotonic() + 30
    while len(seen := traces()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(seen) == before + 1, logs(serving.container)[-2000:]
    trace = seen[-1]
    print(f"trace line from the pod's log: {json.dumps(trace)}", flush=True)
    assert (trace["model"], trace["version"], trace["outcome"]) == (serving.model_name, serving.model_version, "success")
    assert [t["name"] for t in trace["timestamps"]] == ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END",
                                                        "REQUEST_END"]


def test_serving_pod_runs_as_generated(serving: Serving) -> None:
    container = serving.deployment["spec"]["template"]["spec"]["containers"][0]
    pod_sc = serving.deployment["spec"]["template"]["spec"]["securityContext"]
    uid = podman("exec", serving.container, "id", "-u").stdout.strip()
    assert uid == str(pod_sc["runAsUser"]) == str(IMAGE_UID)
    touch = podman("exec", serving.container, "touch", "/kubetrt-e2e-probe", check=False)
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr, touch
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    host = inspect(serving.container)["HostConfig"]
    limits = container["resources"]["limits"]
    assert limits == LIMITS
    assert host["NanoCpus"] == int(quantity(limits["cpu"]) * 1e9)
    assert host["Memory"] == int(quantity(limits["memory"]))
    env = dict(line.split("=", 1) for line in podman("exec", serving.container, "env").stdout.splitlines() if "=" in line)
    for var in container["env"]:  # Downward API values (thread counts from the CPU limit), as a kubelet sets them
        if "resourceFieldRef" in var.get("valueFrom", {}):
            assert env[var["name"]] == resource_field(container, var["valueFrom"]["resourceFieldRef"]), var
    # at most one numba cache line (none where the pod gives numba a writable NUMBA_CACHE_DIR)
    assert len([line for line in logs(serving.container).splitlines() if NUMBA_FALLBACK in line]) <= 1


# ----------------------------------------------------------------------------- a user's own Deployment
def user_deployment(package_dir: Path) -> dict[str, Any]:
    """What a user writes to serve a package from a node directory: read-only root filesystem, no
    HOME, no emptyDir for /tmp or a cache."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "my-example-cnn", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "my-example-cnn"}},
            "template": {
                "metadata": {"labels": {"app": "my-example-cnn"}},
                "spec": {
                    "securityContext": {"runAsNonRoot": True},
                    "containers": [{
                        "name": "server",
                        "image": SERVING_IMAGE,
                        "command": ["kubetrt", "serve", "/models/example-cnn", "--host", "0.0.0.0",
                                    "--port", str(USER_PORT), "--grpc-port", str(USER_PORT + 1)],
                        "ports": [{"containerPort": USER_PORT}],
                        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False},
                        "volumeMounts": [{"name": "model", "mountPath": "/models/example-cnn", "readOnly": True}],
                    }],
                    "volumes": [{"name": "model", "hostPath": {"path": str(package_dir), "type": "Directory"}}],
                },
            },
        },
    }


def test_user_deployment_read_only_root_without_home_or_cache(model: PipelineModel) -> None:
    dep = user_deployment(model.package_dir)
    _port_free(USER_PORT)
    say("playing a user's Deployment (read-only root, no HOME, no emptyDir) serving a hostPath package")
    played = kube_play(dep, model.root)
    try:
        container = played.containers["server"]
        try:
            seconds = wait_http_ready(f"http://127.0.0.1:{USER_PORT}/v2/health/ready", container, timeout=180)
        except PodError as e:
            pytest.fail(str(e), pytrace=False)
        say(f"user's serving pod ready in {seconds:.1f}s")
        log = logs(container)
        fallback = [line for line in log.splitlines() if NUMBA_FALLBACK in line]
        print("numba cache line:", *fallback, flush=True)
        assert len(fallback) == 1, log[-4000:]
        touch = podman("exec", container, "touch", "/tmp/kubetrt-e2e-probe", check=False)
        assert touch.returncode != 0, "expected /tmp to be read-only in this pod"
        assert podman("exec", container, "id", "-u").stdout.strip() == str(IMAGE_UID)
    finally:
        played.down()


# ----------------------------------------------------------------------------- the operator image
def test_operator_image_loads_its_handlers() -> None:
    """The operator image's kopf finds its handlers module, as non-root on a read-only root."""
    proc = podman("run", "--rm", "--label", f"{E2E_LABEL}=1", "--network", "host", "--read-only",
                  "--read-only-tmpfs=false", "--entrypoint", "python", OPERATOR_IMAGE, "-c",
                  "import os, kopf, kubetrt.operators.handlers; print(os.getuid())", check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(IMAGE_UID)
