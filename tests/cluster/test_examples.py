"""manifests/examples/ as shipped, on a real control plane with the chart's operator.

The CPU example: models-volume.yaml's claim, filled by prepare-cpu-example.sh (the example CNN
lowered by `kubetrt lower`, an empty engine store), modeldeployment-cpu.yaml applied from the file
itself, its engine built by the Job, served and queried with /v2/models/NAME/infer, the request in
its comments included. The GPU example: its GPU targets' build pods get the operator's GPU builder
image, the example's pull secret and tolerations beside the GPU one, and its Tesla-T4 target, for
which this cluster has no node, shows why in `kubectl get modeldeployment` within a minute.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

from kube_cluster import REPO, Release, kubectl, kubectl_json, say, wait_until
from kubetrt.operators import names
from kubetrt.runtime.accuracy import TOLERANCES
from kubetrt.runtime.package import load_golden
from node_agent import CPU_NODE, NodeAgent
from podman_pods import BUILDER_IMAGE, SERVING_IMAGE

pytestmark = pytest.mark.cluster

EXAMPLES = REPO / "manifests" / "examples"
CPU_EXAMPLE = EXAMPLES / "modeldeployment-cpu.yaml"
GPU_EXAMPLE = EXAMPLES / "modeldeployment-gpu.yaml"
VOLUME = EXAMPLES / "models-volume.yaml"
PREPARE = EXAMPLES / "prepare-cpu-example.sh"
NS = "default"
HOST_FP32 = TOLERANCES[("fp32", "host")]


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def condition(md: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (md.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def get_row(name: str) -> dict[str, str]:
    """`kubectl get modeldeployment NAME` as {column: value}; the last column (MESSAGE) keeps its spaces."""
    header, row = kubectl("get", "modeldeployment", name, "-n", NS).stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], len(row) + 1])]
    return dict(zip(header.split(), cells))


def dump(name: str, agent: NodeAgent) -> str:
    return (kubectl("get", "modeldeployment,enginebuild,job,deployment,pod,service,pvc", "-n", NS, "-o", "wide",
                    check=False).stdout
            + "\n" + json.dumps(kubectl_json("get", "modeldeployment", name, "-n", NS).get("status"), indent=1)[:3000]
            + "\nnode agent errors: " + "; ".join(agent.errors[-5:]))


def delete_and_wait(path: Path, name: str) -> None:
    kubectl("delete", "-f", str(path), "--wait=true", "--timeout=120s", check=False, timeout=180)

    def gone() -> bool:
        left = kubectl("get", "enginebuild,job,deployment,pod,service", "-n", NS, "-l",
                       f"{names.LABEL_MD}={name}", "-o", "name").stdout.split()
        return not left
    wait_until(f"the objects of {name} deleted", gone, timeout=180, period=1)


# ----------------------------------------------------------------------------- the CPU example
@pytest.fixture(scope="module")
def cpu_example(release: Release, agent: NodeAgent) -> Iterator[dict[str, Any]]:
    (md,) = docs(CPU_EXAMPLE)
    pv = next(d for d in docs(VOLUME) if d["kind"] == "PersistentVolume")
    volume_dir = Path(pv["spec"]["hostPath"]["path"])
    shutil.rmtree(volume_dir, ignore_errors=True)
    volume_dir.mkdir(parents=True)
    say(f"kubectl apply -f {VOLUME.relative_to(REPO)}; bash {PREPARE.relative_to(REPO)} {volume_dir}")
    kubectl("apply", "-f", str(VOLUME))
    env = {**os.environ, "KUBETRT": str(REPO / ".venv/bin/kubetrt"), "PYTHON": str(REPO / ".venv/bin/python")}
    proc = subprocess.run(["bash", str(PREPARE), str(volume_dir)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    say(proc.stdout.strip().splitlines()[-1])
    wait_until("the claim models Bound", lambda: kubectl_json("get", "pvc", "models", "-n", NS)["status"].get(
        "phase") == "Bound", timeout=60)
    name = md["metadata"]["name"]
    say(f"kubectl apply -f {CPU_EXAMPLE.relative_to(REPO)} ({name})")
    kubectl("apply", "-f", str(CPU_EXAMPLE))

    def ready() -> dict[str, Any] | None:
        live: dict[str, Any] = kubectl_json("get", "modeldeployment", name, "-n", NS)
        return live if condition(live, "Ready").get("status") == "True" else None
    live = wait_until(f"{name} Ready", ready, timeout=420, period=2, detail=lambda: dump(name, agent))
    say(f"{name} Ready")
    yield {"md": live, "dir": volume_dir}
    delete_and_wait(CPU_EXAMPLE, name)
    kubectl("delete", "-f", str(VOLUME), "--wait=true", "--timeout=60s", check=False)
    shutil.rmtree(volume_dir, ignore_errors=True)


def ready_pod_address(name: str) -> str:
    pods = kubectl_json("get", "pods", "-n", NS, "-l", f"{names.LABEL_MD}={name},{names.LABEL_APP_COMPONENT}=serving")
    ready = [p for p in pods["items"] if any(c["type"] == "Ready" and c["status"] == "True"
                                             for c in p["status"].get("conditions") or [])]
    assert ready, "no ready serving pod"
    assert ready[0]["spec"]["nodeName"] == CPU_NODE and ready[0]["spec"]["containers"][0]["image"] == SERVING_IMAGE
    return f"{ready[0]['status']['podIP']}:{names.SERVING_PORT}"


def test_cpu_example_names_agree(cpu_example: dict[str, Any]) -> None:
    md = cpu_example["md"]
    name = md["metadata"]["name"]
    assert md["spec"]["model"]["name"] == name, "svc/NAME serves /v2/models/NAME"
    svc = kubectl_json("get", "service", name, "-n", NS)
    assert svc["spec"]["selector"][names.LABEL_MD] == name
    row = get_row(name)
    assert (row["READY"], row["DEGRADED"]) == ("True", "False"), row
    assert row["URL"] == f"http://{name}.{NS}.svc.cluster.local:{names.SERVING_PORT}" == md["status"]["url"]


def test_cpu_example_built_its_engine_into_the_claim(cpu_example: dict[str, Any]) -> None:
    (eb,) = kubectl_json("get", "enginebuilds", "-n", NS, "-l",
                         f"{names.LABEL_MD}={cpu_example['md']['metadata']['name']}")["items"]
    assert (eb["status"]["phase"], eb["status"]["verified"]) == ("Succeeded", True), eb["status"]
    assert eb["spec"]["image"] == BUILDER_IMAGE, "a CPU target: the CPU builder image"
    store = cpu_example["dir"] / "engines"
    assert list(store.glob(f"*/{eb['status']['engineKey']}")), f"no engine {eb['status']['engineKey']} in {store}"


def test_cpu_example_answers_infer_with_tensorflows_outputs(cpu_example: dict[str, Any]) -> None:
    name = cpu_example["md"]["metadata"]["name"]
    address = ready_pod_address(name)
    golden = load_golden(cpu_example["dir"] / name / "package")
    batch = max(golden)
    inputs, outputs = golden[batch]
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "FP32", "data": v.ravel().tolist()}
                       for k, v in inputs.items()]}
    req = urllib.request.Request(f"http://{address}/v2/models/{name}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    say(f"POST /v2/models/{name}/infer at {address}: {len(answer['outputs'])} output(s), batch {batch}")
    assert answer["model_name"] == name
    got = {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"]) for o in answer["outputs"]}
    assert sorted(got) == sorted(outputs)
    for key, want in outputs.items():
        np.testing.assert_allclose(got[key], want, rtol=HOST_FP32, atol=HOST_FP32, err_msg=key)


def test_the_request_in_the_examples_comments_works(cpu_example: dict[str, Any]) -> None:
    """The comment's `python3 ... | curl ... localhost:8080/...` pipeline, run as written but for
    the address (a port-forward's localhost:8080 is the pod's own port)."""
    lines, command = CPU_EXAMPLE.read_text().splitlines(), ""
    for i, line in enumerate(lines):
        if line.startswith("#   python3 -c"):
            for cont in lines[i:]:
                command += cont[1:].strip() + " "
                if not cont.rstrip().endswith("\\") and "infer" in cont:
                    break
            break
    assert "/v2/models/example-cnn/infer" in command, command
    command = command.replace("\\ ", " ").replace("localhost:8080", ready_pod_address(cpu_example["md"]["metadata"]["name"]))
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["outputs"] and answer["outputs"][0]["shape"][0] == 1, proc.stdout[:500]


# ----------------------------------------------------------------------------- the GPU example
@pytest.fixture(scope="module")
def gpu_example(release: Release, agent: NodeAgent) -> Iterator[dict[str, Any]]:
    (md,) = docs(GPU_EXAMPLE)
    say(f"kubectl apply -f {GPU_EXAMPLE.relative_to(REPO)} ({md['metadata']['name']}: "
        f"{', '.join(t['name'] for t in md['spec']['targets'])})")
    applied = time.monotonic()
    kubectl("apply", "-f", str(GPU_EXAMPLE))
    yield {"md": md, "applied": applied}
    delete_and_wait(GPU_EXAMPLE, md["metadata"]["name"])


def operator_env(release: Release) -> dict[str, str]:
    dep = kubectl_json("get", "deployment", release.deployment, "-n", release.namespace)
    return {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def build_pods(md_name: str) -> dict[str, dict[str, Any]]:
    """{target: a build pod} as the Jobs' controller created them."""
    out = {}
    for pod in kubectl_json("get", "pods", "-n", NS, "-l",
                            f"{names.LABEL_MD}={md_name},{names.LABEL_APP_COMPONENT}=engine-build")["items"]:
        out.setdefault(pod["metadata"]["labels"][names.LABEL_TARGET], pod)
    return out


def test_gpu_targets_build_pods_get_the_gpu_image_pull_secret_and_tolerations(
        gpu_example: dict[str, Any], release: Release) -> None:
    md = gpu_example["md"]
    env = operator_env(release)
    gpu_builder = env[names.ENV_BUILDER_IMAGE_GPU]
    assert gpu_builder and gpu_builder != env[names.ENV_BUILDER_IMAGE] == BUILDER_IMAGE, env
    targets = {t["name"]: t for t in md["spec"]["targets"]}
    pods = wait_until("a build pod per target", lambda: (lambda p: p if sorted(p) == sorted(targets) else None)(
        build_pods(md["metadata"]["name"])), timeout=60)
    gpu_toleration = {"key": names.GPU_TAINT_KEY, "operator": "Exists", "effect": names.GPU_TAINT_EFFECT}
    for target, pod in pods.items():
        spec = pod["spec"]
        gpu = "gpuProduct" in targets[target]
        assert spec["containers"][0]["image"] == (gpu_builder if gpu else BUILDER_IMAGE), target
        assert spec["imagePullSecrets"] == md["spec"]["imagePullSecrets"], target
        for toleration in md["spec"]["tolerations"]:
            assert toleration in spec["tolerations"], (target, spec["tolerations"])
        if gpu:
            assert gpu_toleration in spec["tolerations"], target
            assert spec["nodeSelector"][names.GPU_PRODUCT_LABEL] == targets[target]["gpuProduct"]
            assert spec["containers"][0]["resources"]["limits"][names.GPU_RESOURCE] == "1"
        say(f"{target}: build pod image {spec['containers'][0]['image']}, pull secrets "
            f"{[s['name'] for s in spec['imagePullSecrets']]}, {len(spec['tolerations'])} toleration(s)")


def test_gpu_target_without_a_node_says_so_in_kubectl_get_within_a_minute(
        gpu_example: dict[str, Any], release: Release, agent: NodeAgent) -> None:
    md = gpu_example["md"]
    name = md["metadata"]["name"]
    t4 = next(t for t in md["spec"]["targets"] if t.get("gpuProduct") == "Tesla-T4")
    want = f"unschedulable: no node labelled {names.GPU_PRODUCT_LABEL}={t4['gpuProduct']}"
    left = 60 - (time.monotonic() - gpu_example["applied"])
    row = wait_until(f"`kubectl get modeldeployment {name}` saying {want!r}",
                     lambda: (lambda r: r if want in r.get("MESSAGE", "") else None)(get_row(name)),
                     timeout=max(left, 1), period=1, detail=lambda: dump(name, agent))
    say(f"within {time.monotonic() - gpu_example['applied']:.0f}s: kubectl get modeldeployment {name}: "
        + "  ".join(f"{k}={v}" for k, v in row.items()))
    assert row["DEGRADED"] == "True", row
    live = kubectl_json("get", "modeldeployment", name, "-n", NS)
    target = next(t for t in live["status"]["targets"] if t["name"] == t4["name"])
    assert want in target["message"]
    eb = kubectl_json("get", "enginebuild", target["engineBuild"], "-n", NS)
    assert (eb["status"]["phase"], eb["status"]["reason"], eb["status"]["message"]) == ("Pending", "Unschedulable", want)

    def events(kind: str, obj: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = kubectl_json("get", "events", "-n", NS, "--field-selector",
                                                   f"involvedObject.kind={kind},involvedObject.name={obj}")["items"]
        return [e for e in items if e.get("type") == "Warning" and want in e.get("message", "")]

    def recorded() -> bool:
        build = events("EngineBuild", eb["metadata"]["name"])
        # The ModelDeployment's reason is Unschedulable, or TargetsFailing while another target fails too.
        return any(e["reason"] == "Unschedulable" for e in build) and bool(events("ModelDeployment", name))
    wait_until("the operator's Warning Events naming the missing label", recorded, timeout=30, period=1,
               detail=lambda: kubectl("get", "events", "-n", NS, "-o", "wide", check=False).stdout[-4000:])


def test_a_build_whose_secret_is_missing_says_so(gpu_example: dict[str, Any], agent: NodeAgent) -> None:
    """The example's store Secret does not exist here: its CPU target's build pod cannot be
    created (CreateContainerConfigError), which the target's status and Degraded say."""
    md = gpu_example["md"]
    name, secret = md["metadata"]["name"], md["spec"]["store"]["credentialsSecret"]
    cpu = next(t["name"] for t in md["spec"]["targets"] if t.get("cpu"))

    def message() -> str | None:
        live = kubectl_json("get", "modeldeployment", name, "-n", NS)
        target = next((t for t in (live.get("status") or {}).get("targets") or [] if t["name"] == cpu), {})
        return target.get("message") if secret in target.get("message", "") else None
    said = wait_until(f"target {cpu} saying its Secret is missing", message, timeout=60, period=1,
                      detail=lambda: dump(name, agent))
    assert said.startswith("engine build pending: container build: secret") and "not found" in said, said
    degraded = condition(kubectl_json("get", "modeldeployment", name, "-n", NS), "Degraded")
    assert f"target {cpu}: {said}" in degraded["message"]
    say(f"{cpu}: {said}")


# ----------------------------------------------------------------------------- a fallback target
def test_fallback_target_takes_the_service_while_no_primary_target_is_ready(
        cpu_example: dict[str, Any], agent: NodeAgent) -> None:
    """The CPU example with an H100 target added in front of its CPU target, now a fallback: the
    H100 build cannot run here, so the Service selects the fallback's pods; <name>-fallback does
    always."""
    md = cpu_example["md"]
    name = md["metadata"]["name"]
    patch = [{"op": "add", "path": "/spec/targets/0/fallback", "value": True},
             {"op": "add", "path": "/spec/targets/-", "value": {"name": "h100", "gpuProduct": "NVIDIA-H100-80GB-HBM3"}}]
    kubectl("patch", "modeldeployment", name, "-n", NS, "--type=json", "-p", json.dumps(patch))

    def switched() -> dict[str, Any] | None:
        main = kubectl_json("get", "service", name, "-n", NS)
        fallback = kubectl("get", "service", f"{name}-fallback", "-n", NS, "-o", "json", check=False)
        if fallback.returncode != 0 or main["spec"]["selector"].get(names.LABEL_ROLE) != "fallback":
            return None
        pods = kubectl_json("get", "pods", "-n", NS, "-l", ",".join(f"{k}={v}" for k, v in main["spec"]["selector"].items()))
        ready = [p for p in pods["items"] if any(c["type"] == "Ready" and c["status"] == "True"
                                                 for c in p["status"].get("conditions") or [])]
        return {"main": main, "fallback": json.loads(fallback.stdout), "ready": ready} if ready else None
    found = wait_until("the Service selecting the fallback target's ready pods", switched, timeout=240, period=2,
                       detail=lambda: dump(name, agent))
    assert found["fallback"]["spec"]["selector"][names.LABEL_ROLE] == "fallback"
    roles = {t["name"]: t["role"] for t in kubectl_json("get", "modeldeployment", name, "-n", NS)["status"]["targets"]}
    assert roles == {"cpu": "fallback", "h100": "primary"}
    say(f"svc/{name} selects {found['ready'][0]['metadata']['name']} (fallback) while h100 has no ready pod")
