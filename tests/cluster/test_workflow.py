"""The whole flow on a real control plane, with the operator as its chart installs it.

The pipeline's ModelDeployment for a CPU target and two GPU targets -> EngineBuilds -> Jobs -> the
CPU build pod, placed on the CPU node by kube-scheduler and run from the builder image, whose
termination message the operator reads -> the serving Deployment -> ReplicaSet -> pod on the CPU
node from the serving image, with a sidecar sharing its /dev/shm -> Ready -> tritonclient at the
pod's address, and a shared-memory client in the sidecar. The GPU targets' build
pods land on exactly their product's node. Then changes and faults: a new model version rolled
out under a querying client, the operator killed mid-rollout, two operator replicas with
peering, and deletion through the garbage collector.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pytest
import yaml

from kube_cluster import Release, env_path, kubectl, kubectl_json, say, wait_until
from kubetrt.operators import names, reconcile
from kubetrt.operators.kube import KubeClient
from kubetrt.operators.objects import OperatorConfig
from kubetrt.operators.sync import now_iso, observe
from kubetrt.pipeline.deploy import model_deployment
from kubetrt.runtime.accuracy import TOLERANCES
from kubetrt.runtime.target import parse_target
from node_agent import CPU_NODE, GPU_NODES, NodeAgent
from podman_pods import (BUILDER_IMAGE, SERVING_IMAGE, SHM_SIDECAR, assert_sidecar_infers_through_shared_memory,
                         podman)

if TYPE_CHECKING:
    import kubernetes

pytestmark = pytest.mark.cluster

HOST_FP32 = TOLERANCES[("fp32", "host")]
GPU_SPECS = [f"tensorrt@{product}:fp16:1/8/32" for product in GPU_NODES.values()]
COMPUTE = {"NVIDIA-H100-80GB-HBM3": "9.0", "NVIDIA-A100-SXM4-80GB": "8.0"}  # as the GPU nodes resolve them
NS = "default"


# ----------------------------------------------------------------------------- the ModelDeployment
def gpu_engine_records(model: Any) -> list[dict[str, Any]]:
    """What the pipeline's GPU build tasks report on GPU nodes (the GPU boundary: no GPU here)."""
    (host,) = model.engines
    out = []
    for spec in GPU_SPECS:
        target = parse_target(spec)
        target = target.resolve(COMPUTE[target.gpu_product], "10.13")
        out.append({**host, "key": target.key(), "spec": target.spec(), "gpu_product": target.gpu_product,
                    "backend": target.backend, "precision": target.precision,
                    "uri": host["uri"].rsplit("/", 1)[0] + "/" + target.key(), "reused": False,
                    "summary": "verified on a GPU node"})
    return out


@dataclass
class Flow:
    md: dict[str, Any]
    path: Path
    name: str
    cpu_target: str
    gpu_targets: dict[str, str]  # target name -> GPU product

    def get(self) -> dict[str, Any]:
        obj: dict[str, Any] = kubectl_json("get", "modeldeployment", self.name, "-n", NS)
        return obj


@pytest.fixture(scope="module")
def flow(model: Any, release: Release, tmp_path_factory: pytest.TempPathFactory) -> Flow:
    (host,) = model.engines
    md = model_deployment(model.deployment["spec"]["model"]["name"], model.deployment["spec"]["model"]["version"],
                          model.deployment["spec"]["model"]["source"]["uri"], [host, *gpu_engine_records(model)],
                          store_uri=model.deployment["spec"]["store"]["uri"], namespace=NS)
    md["spec"].update(sharedMemory={"sizeLimit": "64Mi"}, sidecars=[SHM_SIDECAR])  # serving pods of two containers
    targets = md["spec"]["targets"]
    cpu = next(t["name"] for t in targets if t.get("cpu"))
    gpus = {t["name"]: t["gpuProduct"] for t in targets if t.get("gpuProduct")}
    assert sorted(gpus.values()) == sorted(GPU_NODES.values()), targets
    path = tmp_path_factory.mktemp("md") / "modeldeployment.yaml"
    path.write_text(yaml.safe_dump(md, sort_keys=False))
    return Flow(md, path, md["metadata"]["name"], cpu, gpus)


def _md_selector(flow: Flow) -> str:
    return f"{names.LABEL_MD}={flow.name}"


def operator_log(agent: NodeAgent) -> str:
    """Every operator container's log (podman keeps it across restarts)."""
    out = []
    for pod in list(agent.pods.values()):
        if pod.namespace == "kubetrt-system":
            proc = podman("logs", pod.container, check=False)
            out.append(f"--- {pod.name}\n{proc.stdout}{proc.stderr}")
    return "\n".join(out)


def _dump(flow: Flow, agent: NodeAgent) -> str:
    return (kubectl("get", "modeldeployment,enginebuild,job,deployment,replicaset,pod,service", "-n", NS, "-o", "wide",
                    check=False).stdout
            + "\n" + json.dumps((flow.get().get("status") or {}), indent=1)[:3000]
            + "\nnode agent errors: " + "; ".join(agent.errors[-5:])
            + "\noperator log tail:\n" + operator_log(agent)[-3000:])


def ready(flow: Flow) -> dict[str, Any] | None:
    md = flow.get()
    st = md.get("status") or {}
    cond: dict[str, Any] = next((c for c in st.get("conditions") or [] if c["type"] == "Ready"), {})
    if cond.get("status") == "True" and st.get("observedGeneration") == md["metadata"]["generation"]:
        return md
    return None


def serving_pods(flow: Flow) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = kubectl_json("get", "pods", "-n", NS, "-l",
                                              f"{_md_selector(flow)},{names.LABEL_APP_COMPONENT}=serving")["items"]
    return pods


def _pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


# ----------------------------------------------------------------------------- the flow
@pytest.fixture(scope="module")
def applied(flow: Flow, agent: NodeAgent) -> Flow:
    say(f"kubectl apply -f modeldeployment.yaml ({flow.name}: targets {flow.cpu_target}, {', '.join(flow.gpu_targets)})")
    kubectl("apply", "-f", str(flow.path))
    wait_until(f"ModelDeployment {flow.name} Ready", lambda: ready(flow), timeout=420, period=2,
               detail=lambda: _dump(flow, agent))
    say(f"{flow.name} Ready")
    return flow


def test_engine_builds_and_jobs_per_target(applied: Flow) -> None:
    ebs = kubectl_json("get", "enginebuilds", "-n", NS, "-l", _md_selector(applied))["items"]
    by_target = {eb["spec"]["target"]["name"]: eb for eb in ebs}
    assert sorted(by_target) == sorted([applied.cpu_target, *applied.gpu_targets])
    jobs = {j["metadata"]["name"] for j in kubectl_json("get", "jobs", "-n", NS, "-l", _md_selector(applied))["items"]}
    assert jobs == {eb["metadata"]["name"] for eb in ebs}
    cpu = by_target[applied.cpu_target]["status"]
    assert (cpu["phase"], cpu["verified"]) == ("Succeeded", True), cpu
    for target in applied.gpu_targets:
        st = by_target[target]["status"]
        assert st["phase"] == "Failed", st  # the GPU nodes here run no containers


def test_cpu_build_ran_on_the_cpu_node_from_the_builder_image(applied: Flow, model: Any, agent: NodeAgent) -> None:
    eb = next(eb for eb in kubectl_json("get", "enginebuilds", "-n", NS, "-l", _md_selector(applied))["items"]
              if eb["spec"]["target"]["name"] == applied.cpu_target)
    pods = kubectl_json("get", "pods", "-n", NS, "-l", f"{names.LABEL_BUILD}={eb['metadata']['name']}")["items"]
    assert pods, "the build pod is gone"
    pod = pods[0]
    assert pod["spec"]["nodeName"] == CPU_NODE
    assert pod["spec"]["containers"][0]["image"] == BUILDER_IMAGE
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    result = json.loads(terminated["message"])  # the build's JSON, as the node reported it
    assert result["verified"] is True and result["engineKey"] == model.key
    assert eb["status"]["engineKey"] == result["engineKey"]  # read by the operator from that message


def test_gpu_build_pods_land_on_their_product_node(applied: Flow, agent: NodeAgent) -> None:
    ebs = kubectl_json("get", "enginebuilds", "-n", NS, "-l", _md_selector(applied))["items"]
    node_of = {product: node for node, product in GPU_NODES.items()}
    for eb in ebs:
        product = eb["spec"]["target"].get("gpuProduct")
        if not product:
            continue
        placed = [p for p in agent.placements.values() if p.labels.get(names.LABEL_BUILD) == eb["metadata"]["name"]]
        assert placed, f"no pod of {eb['metadata']['name']} was scheduled"
        for p in placed:
            assert p.node == node_of[product], (p.name, p.node, product)
            assert p.limits.get(names.GPU_RESOURCE) == "1"
            assert p.node_selector.get(names.GPU_PRODUCT_LABEL) == product
        say(f"{eb['spec']['target']['name']}: {len(placed)} build pod(s), all on {node_of[product]} ({product})")


def test_serving_pod_ready_on_the_cpu_node(applied: Flow) -> None:
    dep = kubectl_json("get", "deployment", f"{applied.name}-{applied.cpu_target}", "-n", NS)
    assert dep["status"]["readyReplicas"] == dep["spec"]["replicas"] == 1
    rs = [r for r in kubectl_json("get", "replicasets", "-n", NS, "-l", _md_selector(applied))["items"]
          if r["status"].get("readyReplicas")]
    assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["name"] == dep["metadata"]["name"]
    (pod,) = [p for p in serving_pods(applied) if _pod_ready(p)]
    assert pod["spec"]["nodeName"] == CPU_NODE and pod["spec"]["containers"][0]["image"] == SERVING_IMAGE
    assert pod["metadata"]["ownerReferences"][0]["name"] == rs[0]["metadata"]["name"]


def test_kubectl_get_shows_ready_degraded_and_url(applied: Flow) -> None:
    wide = kubectl("get", "modeldeployment", applied.name, "-n", NS, "-o", "wide").stdout
    print(wide, flush=True)
    header, row = wide.splitlines()[:2]
    cells = dict(zip(header.split(), row.split()))  # every column before the last (MESSAGE) is one word
    assert cells["READY"] == "True", wide
    assert cells["DEGRADED"] == "True", "the GPU targets' builds failed (no GPU runtime here)"
    assert "NoGPURuntime" in row or "failed" in row, wide
    url = f"http://{applied.name}.{NS}.svc.cluster.local:{names.SERVING_PORT}"
    assert cells["URL"] == url, wide


def _infer(model: Any, address: str, name: str, version: str) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(address, network_timeout=30)
    feeds = []
    for input_name, x in model.inputs.items():
        feed = triton.InferInput(input_name, list(x.shape), "FP32")
        feed.set_data_from_numpy(x, binary_data=True)
        feeds.append(feed)
    result = client.infer(name, feeds, model_version=version)
    for out, ref in model.tensorflow.items():
        np.testing.assert_allclose(result.as_numpy(out), ref, rtol=HOST_FP32, atol=HOST_FP32, err_msg=out)


def test_tritonclient_at_the_pod_address(applied: Flow, model: Any) -> None:
    (pod,) = [p for p in serving_pods(applied) if _pod_ready(p)]
    address = f"{pod['status']['podIP']}:{names.SERVING_PORT}"
    say(f"tritonclient -> {address}")
    spec = applied.get()["spec"]["model"]
    _infer(model, address, spec["name"], spec["version"])


def test_a_sidecar_infers_through_the_pods_shared_memory(applied: Flow, model: Any, agent: NodeAgent) -> None:
    """spec.sidecars and spec.sharedMemory through the real scheduler: the serving pod runs both
    containers, both ready, in one network namespace with one /dev/shm, and a client in the
    sidecar infers through the pod's shared memory."""
    (pod,) = [p for p in serving_pods(applied) if _pod_ready(p)]
    statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
    assert sorted(statuses) == sorted([names.SERVING_CONTAINER, SHM_SIDECAR["name"]])
    assert all(c["ready"] and "running" in c["state"] for c in statuses.values()), statuses
    (sidecar,) = [rc.name for rc in agent.pods[pod["metadata"]["uid"]].containers if rc.spec["name"] == SHM_SIDECAR["name"]]
    spec = applied.get()["spec"]["model"]
    say(f"shared-memory client in {sidecar} -> 127.0.0.1:{names.SERVING_PORT} (the pod's loopback)")
    assert_sidecar_infers_through_shared_memory(sidecar, f"http://127.0.0.1:{names.SERVING_PORT}", spec["name"],
                                                spec["version"], model.inputs, model.tensorflow, HOST_FP32,
                                                names.SHARED_MEMORY_PATH)


# ----------------------------------------------------------------------------- changes and faults
@dataclass
class Client:
    """Queries the model throughout, at a ready pod of the Service's selector each time (what a
    Service's endpoints hold; no kube-proxy runs here, see
    node_agent.py), counting failures: a request that fails, or finds no ready pod."""

    flow: Flow
    model: Any
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    addresses: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        targets: list[str] = []
        refreshed = 0.0
        spec = self.flow.md["spec"]["model"]
        i = 0
        while not self._stop.is_set():
            if time.monotonic() - refreshed > 0.2:
                targets = [p["status"]["podIP"] for p in serving_pods(self.flow)
                           if _pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
                refreshed = time.monotonic()
            if not targets:
                self.failures.append("no ready endpoint")
                time.sleep(0.2)
                continue
            address = f"{targets[i % len(targets)]}:{names.SERVING_PORT}"
            i += 1
            try:
                import tritonclient.http as triton
                client = triton.InferenceServerClient(address, network_timeout=30)
                feeds = []
                for input_name, x in self.model.inputs.items():
                    feed = triton.InferInput(input_name, list(x.shape), "FP32")
                    feed.set_data_from_numpy(x, binary_data=True)
                    feeds.append(feed)
                client.infer(spec["name"], feeds)
                self.ok += 1
                self.addresses.add(address)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                self.failures.append(f"{address}: {type(e).__name__}: {e}"[:300])
            time.sleep(0.05)

    def __enter__(self) -> "Client":
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _set_version(flow: Flow, version: str) -> None:
    kubectl("patch", "modeldeployment", flow.name, "-n", NS, "--type=merge", "-p",
            json.dumps({"spec": {"model": {"version": version}}}))


def _serving_version(flow: Flow) -> str:
    dep = kubectl_json("get", "deployment", f"{flow.name}-{flow.cpu_target}", "-n", NS)
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    return str(command[command.index("--model-version") + 1])


def _rolled_out(flow: Flow, version: str) -> bool:
    if _serving_version(flow) != version or not ready(flow):
        return False
    pods = serving_pods(flow)
    return len(pods) == 1 and _pod_ready(pods[0])


def test_new_version_rolls_out_with_no_failed_request(applied: Flow, model: Any, agent: NodeAgent) -> None:
    before = {p["metadata"]["name"] for p in serving_pods(applied)}
    with Client(applied, model) as client:
        time.sleep(2)
        say("model version 1 -> 2 under a querying client")
        _set_version(applied, "2")
        wait_until("version 2 rolled out", lambda: _rolled_out(applied, "2"), timeout=300, period=1,
                   detail=lambda: _dump(applied, agent))
        time.sleep(2)
    after = {p["metadata"]["name"] for p in serving_pods(applied)}
    say(f"rollout: {client.ok} requests answered, {len(client.failures)} failed, pods {sorted(before)} -> {sorted(after)}")
    assert not (before & after), "the serving pod was not replaced"
    assert len(client.addresses) >= 2, f"the client never reached the new pod: {client.addresses}"
    assert client.failures == [], client.failures[:10]


def _converged(flow: Flow, admin: kubernetes.client.ApiClient) -> list[str]:
    """What the operator's own planner would still change on the live objects (empty: converged)."""
    kube = KubeClient(admin)
    md = flow.get()
    plan = reconcile.plan_model_deployment(md, observe(kube, NS, flow.name), OperatorConfig.from_env({
        names.ENV_SERVING_IMAGE: SERVING_IMAGE, names.ENV_BUILDER_IMAGE: BUILDER_IMAGE,
        names.ENV_IMAGE_PULL_POLICY: "Never"}), now_iso())
    observed = observe(kube, NS, flow.name)
    live = {(o["kind"], name): o for objs in (observed.deployments, observed.services, observed.autoscalers,
                                              observed.engine_builds, observed.disruption_budgets,
                                              observed.service_monitors or {}) for name, o in objs.items()}
    pending = [f"create {o['kind']} {o['metadata']['name']}" for o in plan.create
               if (o["kind"], o["metadata"]["name"]) not in live]
    for o in plan.apply:
        have = live.get((o["kind"], o["metadata"]["name"]))
        want_hash = o["metadata"].get("annotations", {}).get(names.ANN_SPEC_HASH)
        if have is None or (have["metadata"].get("annotations") or {}).get(names.ANN_SPEC_HASH) != want_hash:
            pending.append(f"apply {o['kind']} {o['metadata']['name']}")
    pending += [f"delete {kind} {name}" for _, kind, name in plan.delete]
    return pending


def test_operator_killed_mid_rollout_converges(applied: Flow, agent: NodeAgent,
                                              admin: kubernetes.client.ApiClient) -> None:
    say("model version 2 -> 3; the operator is killed as the new EngineBuild appears")
    _set_version(applied, "3")

    def new_build() -> bool:
        return any(eb["spec"]["model"]["version"] == "3" for eb in
                   kubectl_json("get", "enginebuilds", "-n", NS, "-l", _md_selector(applied))["items"])
    wait_until("the version 3 EngineBuild", new_build, timeout=60)
    operators = [p for p in agent.pods.values() if p.namespace == "kubetrt-system" and p.terminated is None]
    assert operators, "no operator container to kill"
    for op in operators:
        subprocess.run(["podman", "kill", op.container], capture_output=True, timeout=60)
    wait_until("version 3 rolled out after the operator restarted", lambda: _rolled_out(applied, "3"),
               timeout=300, period=1, detail=lambda: _dump(applied, agent))
    restarts = [p.restarts for p in agent.pods.values() if p.namespace == "kubetrt-system"]
    assert max(restarts) >= 1, restarts
    assert _converged(applied, admin) == []
    ebs = kubectl_json("get", "enginebuilds", "-n", NS, "-l", _md_selector(applied))["items"]
    cpu_builds = [eb for eb in ebs if eb["spec"]["target"]["name"] == applied.cpu_target]
    assert [eb["spec"]["model"]["version"] for eb in cpu_builds] == ["3"], "stale builds left behind"


def operator_writes(since: float) -> dict[str, list[str]]:
    """Writes by the operator's ServiceAccount after `since` (epoch seconds), by the pod whose
    bound token made them (the API server's audit log), kopf's own peering keep-alives left out."""
    import datetime as dt
    out: dict[str, list[str]] = {}
    for line in (env_path("KUBETRT_CLUSTER_LOGS") / "audit.log").read_text().splitlines():
        event = json.loads(line)
        user = event.get("user") or {}
        ref = event.get("objectRef") or {}
        if user.get("username") != "system:serviceaccount:kubetrt-system:kubetrt-operator":
            continue
        if ref.get("apiGroup") == "kopf.dev":
            continue
        when = dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
        if when < since:
            continue
        pod = ((user.get("extra") or {}).get("authentication.kubernetes.io/pod-name") or ["?"])[0]
        out.setdefault(pod, []).append(f"{event['verb']} {ref.get('resource')}/{ref.get('subresource', '')} "
                                       f"{ref.get('name', '')} -> {event.get('responseStatus', {}).get('code')}")
    return out


def test_two_operator_replicas_only_one_acts(applied: Flow, agent: NodeAgent, release: Release) -> None:
    say("operator scaled to 2 replicas (kopf peering)")
    kubectl("scale", "deployment", release.deployment, "-n", release.namespace, "--replicas=2")
    try:
        wait_until("two operator pods running", lambda: len([p for p in release.operator_pods()
                                                             if p["status"].get("phase") == "Running"]) == 2,
                   timeout=120)
        time.sleep(10)  # peering keep-alives: the lower priority replica pauses
        since = time.time()
        _set_version(applied, "4")
        wait_until("version 4 rolled out with two operator replicas", lambda: _rolled_out(applied, "4"),
                   timeout=300, period=1, detail=lambda: _dump(applied, agent))
        writes = operator_writes(since)
        say("operator writes after the change, by replica: "
            + ", ".join(f"{pod}: {len(w)}" for pod, w in writes.items()))
        assert len(writes) == 1, json.dumps(writes, indent=1)[:4000]
    finally:
        kubectl("scale", "deployment", release.deployment, "-n", release.namespace, "--replicas=1")


def test_stale_write_is_a_conflict(applied: Flow, admin: kubernetes.client.ApiClient) -> None:
    """The real API server answers a write with an old resourceVersion with 409 (kmock does not)."""
    import kubernetes as k8s
    api = k8s.client.CustomObjectsApi(admin)
    md = api.get_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL_MODEL_DEPLOYMENTS, applied.name)
    stale = copy.deepcopy(md)
    api.patch_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL_MODEL_DEPLOYMENTS, applied.name,
                                       {"metadata": {"annotations": {"kubetrt.io/test": "touched"}}})
    with pytest.raises(k8s.client.ApiException) as err:
        api.replace_namespaced_custom_object_status(names.GROUP, names.VERSION, NS, names.PLURAL_MODEL_DEPLOYMENTS,
                                                    applied.name, stale)
    assert err.value.status == 409


def test_status_conflicts_are_retried(applied: Flow, agent: NodeAgent, admin: kubernetes.client.ApiClient) -> None:
    """While another writer keeps changing the ModelDeployment, the operator's status writes (made
    over the version they were computed from) meet 409 Conflicts; it plans again and converges."""
    import kubernetes as k8s
    api = k8s.client.CustomObjectsApi(admin)
    stop = threading.Event()
    touches = 0

    def touch() -> None:
        nonlocal touches
        while not stop.is_set():
            api.patch_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL_MODEL_DEPLOYMENTS,
                                               applied.name, {"metadata": {"annotations": {"kubetrt.io/touch": str(touches)}}})
            touches += 1
            time.sleep(0.02)
    since = time.time()
    say("model version 4 -> 5 while another writer changes the ModelDeployment's metadata every 20 ms")
    writer = threading.Thread(target=touch, daemon=True)
    writer.start()
    try:
        _set_version(applied, "5")
        wait_until("the operator's status write answered 409", lambda: any(
            "modeldeployments/status" in w and w.endswith("409")
            for writes in operator_writes(since).values() for w in writes), timeout=120, period=1)
    finally:
        stop.set()
        writer.join(timeout=10)
    wait_until("version 5 rolled out after the conflicts", lambda: _rolled_out(applied, "5"), timeout=300, period=1,
               detail=lambda: _dump(applied, agent))
    conflicts = sum(1 for writes in operator_writes(since).values() for w in writes if w.endswith("409"))
    say(f"{touches} metadata writes beside the operator; {conflicts} of its writes answered 409, all retried")
    assert _converged(applied, admin) == []


def test_operator_log_has_no_forbidden(applied: Flow, agent: NodeAgent, release: Release) -> None:
    (pod, *_) = release.operator_pods()
    assert pod["spec"]["serviceAccountName"] == "kubetrt-operator"
    live = kubectl_json("get", "clusterrole", "kubetrt-operator")["rules"]
    manifest = next(d for d in yaml.safe_load_all(Path("manifests/03-rbac.yaml").read_text())
                    if d and d["kind"] == "ClusterRole")["rules"]
    assert live == manifest, "the chart's ClusterRole differs from manifests/03-rbac.yaml"
    log = operator_log(agent)
    assert log.strip(), "no operator log"
    forbidden = [line for line in log.splitlines() if re.search(r"\b403\b|[Ff]orbidden", line)]
    assert forbidden == [], "\n".join(forbidden[:20])


def test_delete_removes_everything_it_owns(applied: Flow, agent: NodeAgent) -> None:
    say(f"kubectl delete modeldeployment {applied.name}: the garbage collector removes its objects")
    kubectl("delete", "modeldeployment", applied.name, "-n", NS, "--wait=true", "--timeout=120s", timeout=180)

    def gone() -> bool:
        left = kubectl("get", "enginebuild,job,deployment,replicaset,pod,service", "-n", NS, "-l",
                       _md_selector(applied), "-o", "name").stdout.split()
        return not left
    wait_until("every object of the ModelDeployment deleted", gone, timeout=180, period=1,
               detail=lambda: kubectl("get", "all,enginebuild", "-n", NS, "-o", "wide").stdout)
