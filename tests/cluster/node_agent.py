"""The cluster tests' kubelet: Node objects as GPU Feature Discovery labels them, and a node agent
that runs the pods the real scheduler binds to the CPU node as podman containers from the
project's images, writing their status back through the API (phase, conditions, container
states, pod IP, the termination message).

Why not a real kubelet: it needs a CRI runtime (containerd or CRI-O) with a CNI network, which
these machines do not carry (Debian bookworm packages neither CRI-O nor a CRI-enabled
containerd with CNI plugins configured for it; podman is not a CRI runtime). This agent does
the kubelet's part that the tests observe, from the pod object as the API server holds it:

* each pod runs in its own network namespace (podman's slirp4netns), its containerPorts
  published on an address of its own, 10.244.0.N, which the agent adds to the host's loopback
  interface and is the pod's status.podIP. Not a 127.x address: the API server's pod proxy
  (`pods/NAME:PORT/proxy/...`, which the operator's canary analysis reads /metrics through)
  refuses loopback pod IPs, as the EndpointSlice controller does. The API server is reachable
  from the pod at 10.0.2.2 (the host's loopback as slirp4netns shows it), given as
  KUBERNETES_SERVICE_HOST/PORT; no kube-proxy runs, so tests pick ready pods by the Service's
  selector, which is what its endpoints hold;
* a pod of several containers (a serving pod with sidecars) runs as a podman pod: one network
  namespace, so its containers reach each other on 127.0.0.1, each container started, probed,
  restarted and reported on its own;
* volumes: emptyDir (medium Memory: a world-writable directory in the host's /dev/shm, one per pod
  and volume, which every container mounting it shares, as a kubelet's tmpfs is), hostPath, a
  PersistentVolumeClaim bound (by the controller manager) to a hostPath PersistentVolume, and the
  projected ServiceAccount volume (a token from the TokenRequest API bound to the pod, the
  kube-root-ca.crt ConfigMap and the namespace);
* env with the Downward API, securityContext, resource limits (tests/containers/podman_pods.py's
  translation); a container whose env names a missing Secret waits in CreateContainerConfigError
  (retried every few seconds, as the kubelet does); readinessProbe httpGet; restartPolicy; graceful deletion (the preStop sleep
  action, SIGTERM, terminationGracePeriodSeconds, then the final delete, as the kubelet does);
* the GPU nodes carry no container runtime here: their pods are recorded (node, resources) and
  reported Failed with reason NoGPURuntime, so their Jobs fail as a node without the runtime
  would make them.
* Node leases are renewed every 10 s, so the node lifecycle controller keeps the nodes Ready.
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import kubernetes

import downward_api
from podman_pods import _resources, _security, _user, logs, podman, process_args, termination_log

CLUSTER_LABEL = "io.kubetrt.cluster"  # on every container the agent starts; e2e-cluster.sh removes leftovers by it
POD_VIEW_OF_HOST = "10.0.2.2"
POD_NET = "10.244.0"  # pod IPs: 10.244.0.N, each added to the host's loopback interface
CPU_NODE = "cpu-node-1"
GPU_NODES = {"gpu-h100-1": "NVIDIA-H100-80GB-HBM3", "gpu-a100-1": "NVIDIA-A100-SXM4-80GB"}
GPU_COMPUTE = {"NVIDIA-H100-80GB-HBM3": ("9", "0", "81559"), "NVIDIA-A100-SXM4-80GB": ("8", "0", "81920")}
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MEMORY_DIR_PREFIX = "kubetrt-cluster-"  # in the host's /dev/shm: e2e-cluster.sh removes what a killed run leaves


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ----------------------------------------------------------------------------- nodes
def node_objects(gpu_taint: tuple[str, str], gpu_resource: str, product_label: str) -> list[dict[str, Any]]:
    """The three Node objects: labels as GPU Feature Discovery writes them, the usual GPU taint."""
    def node(name: str, labels: dict[str, str], extra: dict[str, str], taints: list[dict[str, str]]) -> dict[str, Any]:
        resources = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi", **extra}
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                                  "kubernetes.io/hostname": name, **labels}},
            "spec": {"taints": taints},
            "status": {"capacity": resources, "allocatable": resources,
                       "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                     {"type": "Hostname", "address": name}],
                       "nodeInfo": {"kubeletVersion": "kubetrt-node-agent", "operatingSystem": "linux",
                                    "architecture": "amd64", "containerRuntimeVersion": "podman",
                                    "kernelVersion": os.uname().release, "osImage": "Debian GNU/Linux 12",
                                    "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}},
        }
    out = [node(CPU_NODE, {}, {}, [])]
    key, effect = gpu_taint
    for name, product in GPU_NODES.items():
        major, minor, memory = GPU_COMPUTE[product]
        out.append(node(name, {product_label: product, "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
                               "nvidia.com/gpu.compute.major": major, "nvidia.com/gpu.compute.minor": minor,
                               "nvidia.com/gpu.memory": memory, "nvidia.com/gpu.family": "hopper" if major == "9" else "ampere"},
                        {gpu_resource: "8"}, [{"key": key, "value": "present", "effect": effect}]))
    return out


def node_conditions() -> list[dict[str, str]]:
    t = now()
    ok = {"status": "False", "lastHeartbeatTime": t, "lastTransitionTime": t}
    return [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "node agent is posting ready status",
         "lastHeartbeatTime": t, "lastTransitionTime": t},
        {"type": "MemoryPressure", "reason": "KubeletHasSufficientMemory", "message": "", **ok},
        {"type": "DiskPressure", "reason": "KubeletHasNoDiskPressure", "message": "", **ok},
        {"type": "PIDPressure", "reason": "KubeletHasSufficientPID", "message": "", **ok},
    ]


def register_nodes(api: kubernetes.client.ApiClient, nodes: list[dict[str, Any]]) -> None:
    """Create the nodes (or take them over) and post their status, as a kubelet registers itself."""
    core = kubernetes.client.CoreV1Api(api)
    for n in nodes:
        body = {k: v for k, v in n.items() if k != "status"}
        try:
            core.create_node(body)
        except kubernetes.client.ApiException as e:
            if e.status != 409:
                raise
        status = {**n["status"], "conditions": node_conditions()}
        core.patch_node_status(n["metadata"]["name"], {"status": status})


# ----------------------------------------------------------------------------- pods
@dataclass
class Placement:
    """Where the scheduler put a pod, and what it asked for (recorded for GPU nodes' pods)."""

    namespace: str
    name: str
    node: str
    labels: dict[str, str]
    limits: dict[str, str]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]


@dataclass
class RunningContainer:
    name: str  # podman container name
    spec: dict[str, Any]
    term_host: Path
    started_at: str
    restarts: int = 0
    ready: bool = False
    last_probe: float = 0.0
    terminated: dict[str, Any] | None = None


@dataclass
class RunningPod:
    uid: str
    namespace: str
    name: str
    containers: list[RunningContainer]
    pod_ip: str
    pod_dir: Path
    restart_policy: str
    started_at: str
    podman_pod: str | None = None  # the podman pod of a pod of several containers
    memory_dirs: dict[str, Path] = field(default_factory=dict)  # volume -> its in-memory emptyDir, in the host's /dev/shm
    stopping: bool = False
    status_sent: str = ""

    @property
    def container(self) -> str:
        """The first container's podman name (the only one, for most pods)."""
        return self.containers[0].name

    @property
    def terminated(self) -> dict[str, Any] | None:
        """Set once every container has ended: the first failed one's state, else the first's."""
        if any(c.terminated is None for c in self.containers):
            return None
        return next((c.terminated for c in self.containers if c.terminated and c.terminated["exitCode"]),
                    self.containers[0].terminated)

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.containers)

    @property
    def ready(self) -> bool:
        return all(c.ready and c.terminated is None for c in self.containers)


@dataclass
class NodeAgent:
    """Runs the CPU node's pods, fails the GPU nodes' pods, renews the node leases. Start with
    start(); stop() stops the loop and removes the containers it started."""

    api: kubernetes.client.ApiClient
    nodes: list[str]
    cpu_node: str = CPU_NODE
    api_port: int = 6443
    period_s: float = 0.5
    pods: dict[str, RunningPod] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)  # uid -> placement, every node
    errors: list[str] = field(default_factory=list)
    _next_ip: int = 1
    _addresses: set[str] = field(default_factory=set)  # pod IPs added to the host's loopback interface
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _busy: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_lease: float = 0.0
    _config_retry: dict[str, float] = field(default_factory=dict)  # uid -> when to try a waiting pod again

    # ------------------------------------------------------------------ loop
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="node-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for pod in list(self.pods.values()):
            _remove(pod)
        self.pods.clear()
        for ip in sorted(self._addresses):
            subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], capture_output=True)
        self._addresses.clear()

    def _loop(self) -> None:
        core = kubernetes.client.CoreV1Api(self.api)
        while not self._stop.is_set():
            try:
                if time.monotonic() - self._last_lease > 10:
                    self._renew_leases()
                    self._last_lease = time.monotonic()
                seen: set[str] = set()
                for node in self.nodes:
                    for pod in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items:
                        obj = self.api.sanitize_for_serialization(pod)
                        seen.add(obj["metadata"]["uid"])
                        self._record(obj, node)
                        if node == self.cpu_node:
                            self._sync(obj)
                        else:
                            self._refuse(obj)
                for uid in [u for u in self.pods if u not in seen and u not in self._busy]:
                    self._forget(uid)  # deleted with grace 0 by someone else: the container goes too
                self._watch_containers()
            except Exception as e:  # noqa: BLE001 - the agent keeps going, the tests read its errors
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.period_s)

    def _background(self, uid: str, fn: Callable[[], None]) -> None:
        with self._lock:
            if uid in self._busy:
                return
            self._busy.add(uid)

        def run() -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._busy.discard(uid)
        threading.Thread(target=run, daemon=True).start()

    def _renew_leases(self) -> None:
        coord = kubernetes.client.CoordinationV1Api(self.api)
        for node in self.nodes:
            body = {"metadata": {"name": node, "namespace": "kube-node-lease"},
                    "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": now_micro()}}
            try:
                coord.patch_namespaced_lease(node, "kube-node-lease", {"spec": body["spec"]})
            except kubernetes.client.ApiException as e:
                if e.status != 404:
                    raise
                coord.create_namespaced_lease("kube-node-lease", body)

    # ------------------------------------------------------------------ status
    def _patch_status(self, ns: str, name: str, status: Mapping[str, Any]) -> None:
        try:
            self.api.call_api(f"/api/v1/namespaces/{ns}/pods/{name}/status", "PATCH",
                              body={"status": dict(status)}, auth_settings=["BearerToken"],
                              header_params={"Content-Type": "application/merge-patch+json",
                                             "Accept": "application/json"},
                              _preload_content=False)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    def _record(self, pod: Mapping[str, Any], node: str) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        if meta["uid"] in self.placements:
            return
        limits: dict[str, str] = {}
        for c in spec["containers"]:
            limits.update({k: str(v) for k, v in ((c.get("resources") or {}).get("limits") or {}).items()})
        self.placements[meta["uid"]] = Placement(meta["namespace"], meta["name"], node, dict(meta.get("labels") or {}),
                                                 limits, dict(spec.get("nodeSelector") or {}),
                                                 list(spec.get("tolerations") or []))

    def _refuse(self, pod: Mapping[str, Any]) -> None:
        """A GPU node's pod: no GPU container runtime here, so it fails (its placement is recorded)."""
        meta, st = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            kubernetes.client.CoreV1Api(self.api).delete_namespaced_pod(meta["name"], meta["namespace"],
                                                                         grace_period_seconds=0)
            return
        if st.get("phase") in ("Succeeded", "Failed"):
            return
        t = now()
        message = "the test cluster's GPU nodes run no containers (no GPU container runtime)"
        self._patch_status(meta["namespace"], meta["name"], {
            "phase": "Failed", "reason": "NoGPURuntime", "message": message, "startTime": t, "hostIP": "127.0.0.1",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                           {"type": "Ready", "status": "False", "reason": "PodFailed", "lastTransitionTime": t}],
            "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                                   "restartCount": 0, "started": False,
                                   "state": {"terminated": {"exitCode": 128, "reason": "NoGPURuntime",
                                                            "message": message, "startedAt": t, "finishedAt": t}}}
                                  for c in pod["spec"]["containers"]],
        })

    def _pod_status(self, pod: RunningPod) -> dict[str, Any]:
        t = now()
        statuses = []
        for rc in pod.containers:
            cs: dict[str, Any] = {"name": rc.spec["name"], "image": rc.spec["image"], "imageID": rc.spec["image"],
                                  "containerID": f"podman://{rc.name}", "restartCount": rc.restarts}
            if rc.terminated is not None:
                cs.update(ready=False, started=False, state={"terminated": rc.terminated})
            else:
                cs.update(ready=rc.ready, started=True, state={"running": {"startedAt": rc.started_at}})
            statuses.append(cs)
        ready = "True" if pod.ready else "False"
        conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                      {"type": "ContainersReady", "status": ready}, {"type": "Ready", "status": ready}]
        phase = "Running"
        ended = pod.terminated
        if ended is not None and pod.restart_policy != "Always":
            failed = ended["exitCode"] != 0
            if not failed or pod.restart_policy == "Never":
                phase = "Failed" if failed else "Succeeded"
        return {"phase": phase, "podIP": pod.pod_ip, "podIPs": [{"ip": pod.pod_ip}], "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}], "startTime": pod.started_at, "containerStatuses": statuses,
                "conditions": [{**cond, "lastTransitionTime": t} for cond in conditions]}

    def _report(self, pod: RunningPod) -> None:
        status = self._pod_status(pod)
        key = json.dumps({k: v for k, v in status.items() if k != "conditions"}, sort_keys=True) + \
            json.dumps([c["status"] for c in status["conditions"]])
        if key != pod.status_sent:
            self._patch_status(pod.namespace, pod.name, status)
            pod.status_sent = key

    # ------------------------------------------------------------------ the CPU node
    def _sync(self, pod: Mapping[str, Any]) -> None:
        meta, st = pod["metadata"], pod.get("status") or {}
        uid = meta["uid"]
        if meta.get("deletionTimestamp"):
            grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            self._background(uid, lambda: self._terminate(uid, meta["namespace"], meta["name"], grace))
            return
        if uid in self.pods or st.get("phase") in ("Succeeded", "Failed"):
            return
        if time.monotonic() < self._config_retry.get(uid, 0.0):
            return
        self._background(uid, lambda: self._run(pod))

    def _terminate(self, uid: str, ns: str, name: str, grace: int) -> None:
        running = self.pods.get(uid)
        if running is not None:
            running.stopping = True
            if running.terminated is None:
                for rc in running.containers:
                    rc.ready = False
                self._report(running)
                pause = max((int(sleep["seconds"]) for rc in running.containers
                             if (sleep := ((rc.spec.get("lifecycle") or {}).get("preStop") or {}).get("sleep"))),
                            default=0)
                if pause:  # the preStop sleep actions (side by side), within the grace period
                    pause = min(pause, grace)
                    time.sleep(pause)
                    grace -= pause
            podman("stop", "-t", str(grace), *(rc.name for rc in running.containers), check=False, timeout=grace + 60)
            self._forget(uid)
        try:
            kubernetes.client.CoreV1Api(self.api).delete_namespaced_pod(
                name, ns, grace_period_seconds=0,
                body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0,
                                                       preconditions=kubernetes.client.V1Preconditions(uid=uid)))
        except kubernetes.client.ApiException as e:
            if e.status not in (404, 409):
                raise

    def _forget(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        if pod is not None:
            _remove(pod)

    def _pod_ip(self) -> str:
        ip = f"{POD_NET}.{self._next_ip}"
        self._next_ip = self._next_ip % 250 + 1
        if ip not in self._addresses:
            proc = subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], capture_output=True, text=True)
            if proc.returncode != 0 and "exists" not in proc.stderr:
                raise RuntimeError(f"ip addr add {ip}/32 dev lo: {proc.stderr.strip()}")
            self._addresses.add(ip)
        return ip

    def _run(self, pod: Mapping[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if spec.get("initContainers"):
            raise RuntimeError(f"pod {ns}/{name}: the node agent runs no init containers")
        envs = {}
        for c in spec["containers"]:
            try:
                envs[c["name"]] = {"KUBERNETES_SERVICE_HOST": POD_VIEW_OF_HOST, "KUBERNETES_SERVICE_PORT": str(self.api_port),
                                   "KUBERNETES_SERVICE_PORT_HTTPS": str(self.api_port),
                                   **downward_api.container_env(c, name, ns, secrets=self._secrets(ns, c))}
            except ValueError as e:
                reason, _, message = str(e).partition(": ")
                if reason != "CreateContainerConfigError":
                    raise
                self._config_retry[uid] = time.monotonic() + 5
                self._waiting(pod, c["name"], reason, message)
                return
        self._config_retry.pop(uid, None)
        pod_dir = Path(tempfile.mkdtemp(prefix=f"kubetrt-cluster-{name[:40]}-"))
        os.chmod(pod_dir, 0o755)
        ip = self._pod_ip()
        pod_sc = spec.get("securityContext") or {}
        network = ["--network", "slirp4netns:allow_host_loopback=true", "--hostname", name[:63]]
        ports = [arg for c in spec["containers"] for port in c.get("ports") or []
                 for arg in ("-p", f"{ip}:{port['containerPort']}:{port['containerPort']}/{port.get('protocol', 'TCP').lower()}")]
        running = RunningPod(uid, ns, name, [], ip, pod_dir, spec.get("restartPolicy", "Always"), now())
        if len(spec["containers"]) > 1:  # one network namespace for all: a podman pod holds it
            running.podman_pod = f"k8s_{ns}_{name}"[:120]
            podman("pod", "rm", "-f", running.podman_pod, check=False)
            podman("pod", "create", "--name", running.podman_pod, "--label", f"{CLUSTER_LABEL}={uid}", *network, *ports,
                   timeout=120)
            placement = ["--pod", running.podman_pod]
        else:
            placement = [*network, *ports]
        for c in spec["containers"]:
            container = f"k8s_{ns}_{name}_{c['name']}"[:120]
            sc = c.get("securityContext") or {}
            container_dir = pod_dir / c["name"]
            container_dir.mkdir()
            os.chmod(container_dir, 0o755)
            term_host, term_mount = termination_log(c, container_dir)
            args = ["run", "--detach", "--name", container, "--label", f"{CLUSTER_LABEL}={uid}", *placement,
                    "--pull", "never", *_user(pod_sc, sc, c["image"]), *_security(sc, pod_sc),
                    *_resources(c.get("resources") or {}), *self._volumes(pod, c, running),
                    *term_mount, *process_args(c, envs[c["name"]])]
            podman("rm", "-f", "-t", "0", container, check=False)
            rc = RunningContainer(container, c, term_host, now())
            running.containers.append(rc)
            proc = podman(*args, check=False, timeout=300)
            if proc.returncode != 0:
                rc.terminated = {"exitCode": 128, "reason": "ContainerCannotRun", "message": proc.stderr[-2000:],
                                 "startedAt": rc.started_at, "finishedAt": now()}
            rc.ready = proc.returncode == 0 and "readinessProbe" not in c
        self.pods[uid] = running
        self._report(running)

    def _waiting(self, pod: Mapping[str, Any], container: str, reason: str, message: str) -> None:
        """A container of the pod cannot be created yet: Pending, that container waiting with the
        reason, the others still being created."""
        meta, containers = pod["metadata"], pod["spec"]["containers"]
        have = [cs.get("state", {}).get("waiting", {}) for cs in (pod.get("status") or {}).get("containerStatuses") or []
                if cs["name"] == container]
        if have and have[0].get("reason") == reason and have[0].get("message") == message:
            return  # reported already: the retry found the same
        t = now()
        self._patch_status(meta["namespace"], meta["name"], {
            "phase": "Pending", "hostIP": "127.0.0.1",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                           {"type": "Ready", "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": t}],
            "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                                   "restartCount": 0, "started": False,
                                   "state": {"waiting": {"reason": reason, "message": message} if c["name"] == container
                                             else {"reason": "ContainerCreating"}}} for c in containers]})

    def _secrets(self, ns: str, c: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        names = {s["secretRef"]["name"] for s in c.get("envFrom") or [] if "secretRef" in s}
        names |= {v["valueFrom"]["secretKeyRef"]["name"] for v in c.get("env") or []
                  if "secretKeyRef" in (v.get("valueFrom") or {})}
        out = {}
        core = kubernetes.client.CoreV1Api(self.api)
        for n in names:
            try:
                secret = core.read_namespaced_secret(n, ns)
            except kubernetes.client.ApiException as e:
                if e.status == 404:
                    continue
                raise
            out[n] = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        return out

    def _volumes(self, pod: Mapping[str, Any], c: Mapping[str, Any], running: RunningPod) -> list[str]:
        """The container's mounts; an in-memory emptyDir is made once per pod (running.memory_dirs),
        so every container mounting it shares it."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        memory = running.memory_dirs
        args: list[str] = []
        for mount in c.get("volumeMounts") or []:
            vol = volumes[mount["name"]]
            ro = ":ro" if mount.get("readOnly") else ""
            host = running.pod_dir / "volumes" / mount["name"]
            if "emptyDir" in vol and (vol["emptyDir"] or {}).get("medium") == "Memory":
                if mount["name"] not in memory:
                    memory[mount["name"]] = Path(tempfile.mkdtemp(prefix=MEMORY_DIR_PREFIX, dir="/dev/shm"))
                    os.chmod(memory[mount["name"]], 0o1777)
                host = memory[mount["name"]]
            elif "emptyDir" in vol:
                host.mkdir(parents=True, exist_ok=True)
                os.chmod(host, 0o777)
            elif "hostPath" in vol:
                path, kind = vol["hostPath"]["path"], vol["hostPath"].get("type", "")
                if kind == "DirectoryOrCreate":
                    Path(path).mkdir(parents=True, exist_ok=True)
                elif kind == "Directory" and not Path(path).is_dir():
                    raise RuntimeError(f"hostPath {path} is not a directory")
                host = Path(path)
            elif "persistentVolumeClaim" in vol:
                host = self._claimed_path(pod["metadata"]["namespace"], vol["persistentVolumeClaim"])
                if vol["persistentVolumeClaim"].get("readOnly"):
                    ro = ":ro"
            elif "projected" in vol:
                self._projected(pod, vol["projected"], host)
                ro = ":ro"
            else:
                raise RuntimeError(f"volume {mount['name']}: the node agent mounts emptyDir, hostPath, hostPath-backed "
                                   f"PersistentVolumeClaims and projected ServiceAccount volumes, not {sorted(vol)}")
            if mount.get("subPath"):
                host = host / mount["subPath"]
            args += ["-v", f"{host}:{mount['mountPath']}{ro}"]
        return args

    def _claimed_path(self, namespace: str, source: Mapping[str, Any]) -> Path:
        """The directory of the hostPath PersistentVolume the claim is bound to (the scheduler binds
        no pod before its claims are bound)."""
        core = kubernetes.client.CoreV1Api(self.api)
        claim = core.read_namespaced_persistent_volume_claim(source["claimName"], namespace)
        if claim.status.phase != "Bound" or not claim.spec.volume_name:
            raise RuntimeError(f"claim {namespace}/{source['claimName']} is {claim.status.phase}, not Bound")
        volume = core.read_persistent_volume(claim.spec.volume_name)
        if volume.spec.host_path is None:
            raise RuntimeError(f"PersistentVolume {volume.metadata.name}: the node agent mounts hostPath volumes only")
        path = Path(volume.spec.host_path.path)
        if not path.is_dir():
            raise RuntimeError(f"PersistentVolume {volume.metadata.name}: {path} is not a directory")
        return path

    def _projected(self, pod: Mapping[str, Any], projected: Mapping[str, Any], host: Path) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        host.mkdir(parents=True, exist_ok=True)
        os.chmod(host, 0o755)
        core = kubernetes.client.CoreV1Api(self.api)
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                req = {"spec": {"audiences": [sat["audience"]] if sat.get("audience") else None,
                                "expirationSeconds": sat.get("expirationSeconds", 3607),
                                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                                   "uid": meta["uid"]}}}
                token = core.create_namespaced_service_account_token(
                    spec.get("serviceAccountName", "default"), meta["namespace"], req)
                (host / sat["path"]).write_text(token.status.token)
            elif "configMap" in source:
                cm = core.read_namespaced_config_map(source["configMap"]["name"], meta["namespace"])
                for item in source["configMap"].get("items") or [{"key": k, "path": k} for k in cm.data or {}]:
                    (host / item["path"]).write_text((cm.data or {})[item["key"]])
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items") or []:
                    path = item["fieldRef"]["fieldPath"]
                    if path != "metadata.namespace":
                        raise RuntimeError(f"projected downwardAPI {path!r} is not supported by the node agent")
                    (host / item["path"]).write_text(meta["namespace"])
            else:
                raise RuntimeError(f"projected source {sorted(source)} is not supported by the node agent")
        for f in host.iterdir():
            os.chmod(f, 0o644)

    # ------------------------------------------------------------------ containers
    def _watch_containers(self) -> None:
        if not self.pods:
            return
        out = podman("ps", "-a", "--format", "json", "--filter", f"label={CLUSTER_LABEL}", check=False).stdout
        states = {c["Names"][0]: c for c in json.loads(out or "[]")}
        for pod in list(self.pods.values()):
            if pod.stopping or pod.uid in self._busy:
                continue
            for rc in pod.containers:
                state = states.get(rc.name)
                if rc.terminated is None and state is not None and state.get("Exited"):
                    self._exited(pod, rc, int(state.get("ExitCode", 0)))
                elif rc.terminated is None and "readinessProbe" in rc.spec:
                    self._probe(pod, rc)
            self._report(pod)

    def _exited(self, pod: RunningPod, rc: RunningContainer, code: int) -> None:
        c = rc.spec
        text = rc.term_host.read_text(errors="replace")[:4096]
        if not text.strip() and code != 0 and c.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            text = "\n".join(logs(rc.name).splitlines()[-80:])[-2048:]
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": rc.started_at,
                      "finishedAt": now(), "containerID": f"podman://{rc.name}"}
        if text:
            terminated["message"] = text
        restart = pod.restart_policy == "Always" or (pod.restart_policy == "OnFailure" and code != 0)
        if restart:
            rc.restarts += 1
            rc.ready = False
            podman("start", rc.name, check=False)
            rc.started_at = now()
        else:
            rc.terminated = terminated
            rc.ready = False

    def _probe(self, pod: RunningPod, rc: RunningContainer) -> None:
        probe = rc.spec["readinessProbe"]
        if time.monotonic() - rc.last_probe < min(float(probe.get("periodSeconds", 10)), 1.0):
            return
        rc.last_probe = time.monotonic()
        get = probe.get("httpGet")
        if get is None:
            raise RuntimeError(f"pod {pod.name}: the node agent runs httpGet readiness probes only")
        port = get["port"]
        if isinstance(port, str) and not port.isdigit():
            port = next(p["containerPort"] for p in rc.spec.get("ports") or [] if p.get("name") == port)
        try:
            with urllib.request.urlopen(f"http://{pod.pod_ip}:{port}{get.get('path', '/')}",
                                        timeout=float(probe.get("timeoutSeconds", 1))) as resp:
                rc.ready = 200 <= resp.status < 400
        except (urllib.error.URLError, ConnectionError, OSError):
            rc.ready = False


def _remove(pod: RunningPod) -> None:
    """The pod's containers (its podman pod too), its directory and its in-memory volumes."""
    podman("rm", "-f", "-t", "0", *(rc.name for rc in pod.containers), check=False)
    if pod.podman_pod is not None:
        podman("pod", "rm", "-f", pod.podman_pod, check=False)
    shutil.rmtree(pod.pod_dir, ignore_errors=True)
    for d in pod.memory_dirs.values():
        shutil.rmtree(d, ignore_errors=True)
