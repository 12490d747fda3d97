"""Pods of generated Kubernetes objects, run by podman (see DESIGN.md, "Test environment").

Two ways, both from the object as generated (nothing here writes a command line of its own):

* ``kube_play``: ``podman kube play --network host`` of a Deployment or Pod (securityContext,
  readOnlyRootFilesystem, resource limits, Downward API resourceFieldRef env, emptyDir and hostPath
  volumes are honoured by podman 4.3 itself);
* ``run_pod``: one container of a pod spec as ``podman run``, the arguments assembled by code the
  way a kubelet would, for what kube play cannot honour: ``terminationMessagePath`` (kube play
  leaves /dev root-owned and read-only to a non-root user, so the build's JSON result could not be
  written). Unknown fields fail loudly instead of being ignored, so a generator change that this
  translation does not understand shows up here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

import downward_api
from downward_api import quantity

E2E_LABEL = "io.kubetrt.e2e"  # on everything the tests start; scripts/e2e-containers.sh removes leftovers by it
TAG = os.environ.get("KUBETRT_E2E_TAG", "e2e")  # the images scripts/e2e-containers.sh builds
SERVING_IMAGE = f"localhost/kubetrt/serving:{TAG}"
BUILDER_IMAGE = f"localhost/kubetrt/builder:{TAG}"
OPERATOR_IMAGE = f"localhost/kubetrt/operator:{TAG}"
IMAGE_UID = 65532  # USER of docker/*.Dockerfile
# A user's preprocessing container beside the server (spec.sidecars), idle until a test runs a client in it
SHM_SIDECAR = {"name": "preprocess", "image": SERVING_IMAGE, "command": ["python", "-c", "import time; time.sleep(1e9)"]}
SHM_CLIENT = Path(__file__).with_name("shm_sidecar_client.py")
_START = time.monotonic()


def say(message: str) -> None:
    """A progress line in the CI log (the script runs pytest -s)."""
    print(f"[e2e test {time.monotonic() - _START:5.1f}s] {message}", flush=True)


POD_KEYS = {"restartPolicy", "nodeSelector", "tolerations", "securityContext", "containers", "volumes",
            "serviceAccountName", "automountServiceAccountToken", "activeDeadlineSeconds"}
CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "resources",
                  "securityContext", "terminationMessagePath", "terminationMessagePolicy", "volumeMounts",
                  "workingDir", "ports", "readinessProbe", "livenessProbe", "startupProbe"}


class PodError(RuntimeError):
    """The pod spec uses something this translation (or this node) cannot run."""


# ----------------------------------------------------------------------------- podman
def podman(*args: str, check: bool = True, timeout: float = 120.0,
           stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and proc.returncode != 0:
        raise PodError(f"podman {' '.join(args[:3])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def inspect(name: str) -> dict[str, Any]:
    return json.loads(podman("inspect", "--type", "container", name).stdout)[0]


def logs(name: str) -> str:
    proc = podman("logs", name, check=False)
    return proc.stdout + proc.stderr


def termination_log(c: Mapping[str, Any], pod_dir: Path) -> tuple[Path, list[str]]:
    """The file the container's terminationMessagePath is, on the node (writable by the container's
    user, as the kubelet's is), and its `podman run` mount."""
    term_host = pod_dir / "termination-log"
    term_host.write_text("")
    os.chmod(term_host, 0o666)
    return term_host, ["-v", f"{term_host}:{c.get('terminationMessagePath', '/dev/termination-log')}"]


def process_args(c: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The container's env, working directory, command, image and args as `podman run` arguments."""
    args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    if c.get("workingDir"):
        args += ["--workdir", c["workingDir"]]
    if c.get("command"):
        args += ["--entrypoint", json.dumps(c["command"])]
    return [*args, c["image"], *[str(a) for a in c.get("args") or []]]


def image_exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def images_missing() -> str | None:
    """Why the project's images cannot run here (no podman, images not built), or None."""
    if shutil.which("podman") is None:
        return "podman is not installed"
    missing = [i for i in (SERVING_IMAGE, BUILDER_IMAGE, OPERATOR_IMAGE) if not image_exists(i)]
    return f"images {', '.join(missing)} are not built" if missing else None


# ----------------------------------------------------------------------------- quantities, Downward API
def container_env(container: Mapping[str, Any], pod_name: str, namespace: str) -> dict[str, str]:
    """env resolved as the kubelet does (the image's own env comes from the image)."""
    try:
        return downward_api.container_env(container, pod_name, namespace)
    except ValueError as e:
        raise PodError(str(e)) from None


# ----------------------------------------------------------------------------- podman run from a pod spec
@dataclass
class RunPod:
    """One container of a pod spec started with `podman run` (see run_pod)."""

    name: str
    argv: list[str]
    pod_dir: Path
    termination_log: Path | None
    termination_policy: str
    deadline_s: float | None

    def wait(self, timeout: float) -> int:
        """Exit code once the container has exited (activeDeadlineSeconds caps `timeout`)."""
        if self.deadline_s is not None:
            timeout = min(timeout, self.deadline_s)
        try:
            out = podman("wait", self.name, timeout=timeout).stdout.strip()
        except subprocess.TimeoutExpired:
            podman("stop", "-t", "5", self.name, check=False)
            raise PodError(f"{self.name} did not finish within {timeout:.0f}s; log tail:\n{logs(self.name)[-3000:]}")
        return int(out.splitlines()[-1])

    def termination_message(self, exit_code: int) -> str:
        """What the kubelet would report: the file (at most 4096 bytes), or with
        FallbackToLogsOnError after a failure and an empty file, the log's last 80 lines."""
        text = self.termination_log.read_text(errors="replace")[:4096] if self.termination_log else ""
        if not text.strip() and exit_code != 0 and self.termination_policy == "FallbackToLogsOnError":
            text = "\n".join(logs(self.name).splitlines()[-80:])[-2048:]
        return text

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)
        shutil.rmtree(self.pod_dir, ignore_errors=True)


def _user(pod_sc: Mapping[str, Any], sc: Mapping[str, Any], image: str) -> list[str]:
    """--user/--group-add from runAsUser/runAsGroup/fsGroup; runAsNonRoot checked as the kubelet does."""
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        effective = uid
        if effective is None:  # the kubelet checks the image's USER, and refuses a non-numeric one
            user = json.loads(podman("image", "inspect", image).stdout)[0]["Config"].get("User", "") or "0"
            if not user.split(":")[0].isdigit():
                raise PodError(f"runAsNonRoot with non-numeric image user {user!r}")
            effective = int(user.split(":")[0])
        if int(effective) == 0:
            raise PodError("runAsNonRoot, but the container would run as root")
    args: list[str] = []
    if uid is not None:
        args += ["--user", f"{uid}:{gid if gid is not None else 0}"]
    for g in [pod_sc.get("fsGroup"), *(pod_sc.get("supplementalGroups") or [])]:
        if g is not None:
            args += ["--group-add", str(g)]
    return args


def _security(sc: Mapping[str, Any], pod_sc: Mapping[str, Any]) -> list[str]:
    args: list[str] = []
    if sc.get("privileged"):
        args.append("--privileged")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities") or {}
    args += [f"--cap-drop={c.lower()}" for c in caps.get("drop") or []]
    args += [f"--cap-add={c.lower()}" for c in caps.get("add") or []]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]  # a kubelet adds no tmpfs at /tmp
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise PodError(f"seccompProfile {seccomp!r} is not supported here")
    return args


def _resources(resources: Mapping[str, Any]) -> list[str]:
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    unknown = (set(limits) | set(requests)) - {"cpu", "memory", "ephemeral-storage"}
    if unknown:
        raise PodError(f"this node cannot provide {sorted(unknown)}")
    args = []
    if "cpu" in limits:
        args.append(f"--cpus={quantity(limits['cpu']):g}")
    if "memory" in limits:
        args.append(f"--memory={int(quantity(limits['memory']))}")
    cpu_request = requests.get("cpu", limits.get("cpu"))
    if cpu_request is not None:  # the kubelet's cpu.shares for a request
        args.append(f"--cpu-shares={max(2, int(round(quantity(cpu_request) * 1000)) * 1024 // 1000)}")
    return args


def run_pod(obj: Mapping[str, Any], pod_name: str, *, container: str | None = None) -> RunPod:
    """Start one container of `obj` (a Pod, or a Job/Deployment's pod template) with podman run."""
    spec = obj["spec"]["template"]["spec"] if obj["kind"] in ("Job", "Deployment") else obj["spec"]
    unknown = set(spec) - POD_KEYS
    if unknown:
        raise PodError(f"pod spec fields not handled here: {sorted(unknown)}")
    if spec.get("restartPolicy", "Always") != "Never":
        raise PodError("run_pod runs pods that are not restarted (restartPolicy Never); use kube_play")
    for key, value in (spec.get("nodeSelector") or {}).items():
        if (key, value) != ("kubernetes.io/os", "linux"):
            raise PodError(f"this node does not carry the label {key}={value}")
    (c,) = [c for c in spec["containers"] if container in (None, c["name"])]
    unknown = set(c) - CONTAINER_KEYS
    if unknown:
        raise PodError(f"container fields not handled here: {sorted(unknown)}")
    namespace = obj["metadata"].get("namespace", "default")
    name = f"{pod_name}-{c['name']}"
    pod_dir = Path(tempfile.mkdtemp(prefix=f"kubetrt-e2e-{pod_name}-"))
    os.chmod(pod_dir, 0o755)
    pod_sc, sc = spec.get("securityContext") or {}, c.get("securityContext") or {}
    user_args = _user(pod_sc, sc, c["image"])
    args = ["run", "--detach", "--name", name, "--label", f"{E2E_LABEL}=1", "--network", "host",
            "--hostname", pod_name, "--pull", "never", *user_args, *_security(sc, pod_sc),
            *_resources(c.get("resources") or {})]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    for mount in c.get("volumeMounts") or []:
        vol = volumes[mount["name"]]
        ro = ":ro" if mount.get("readOnly") else ""
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory":
                args += ["--tmpfs", f"{mount['mountPath']}:rw,mode=1777"]
            else:  # a fresh directory on the node's disk, mode 0777 like the kubelet's
                host = pod_dir / "volumes" / mount["name"]
                host.mkdir(parents=True)
                os.chmod(host, 0o777)
                args += ["-v", f"{host}:{mount['mountPath']}{ro}"]
        elif "hostPath" in vol:
            path, kind = vol["hostPath"]["path"], vol["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                Path(path).mkdir(parents=True, exist_ok=True)
            elif kind == "Directory" and not Path(path).is_dir():
                raise PodError(f"hostPath {path} is not a directory")
            elif kind not in ("", "Directory"):
                raise PodError(f"hostPath type {kind!r} is not supported here")
            args += ["-v", f"{path}:{mount['mountPath']}{ro}"]
        else:
            raise PodError(f"volume {mount['name']}: only emptyDir and hostPath are supported here: {vol!r}")
    term_host, term_mount = termination_log(c, pod_dir)
    args += [*term_mount, *process_args(c, container_env(c, pod_name, namespace))]
    podman("rm", "-f", "-t", "0", name, check=False)
    podman(*args)
    return RunPod(name, ["podman", *args], pod_dir, term_host, c.get("terminationMessagePolicy", "File"),
                  spec.get("activeDeadlineSeconds"))


# ----------------------------------------------------------------------------- podman kube play
@dataclass
class Played:
    """Objects played with `podman kube play` from one YAML file."""

    path: Path
    pod: str
    containers: dict[str, str]  # container name in the spec -> podman container name
    memory_dirs: tuple[Path, ...] = ()  # the in-memory emptyDirs' directories (kube_play)

    def down(self) -> None:
        podman("kube", "down", str(self.path), check=False)
        for d in self.memory_dirs:
            shutil.rmtree(d, ignore_errors=True)


def kube_play(obj: Mapping[str, Any], workdir: Path) -> Played:
    """`podman kube play --network host` of a Deployment or Pod, as generated but for three things:
    the e2e label on the pod (for the cleanup of leftovers); no containerPorts: podman 4.3
    turns them into port mappings, which it refuses on the host network ("PortMappings can only be
    used with Bridge or slirp4netns networking"), and on the host network they map nothing anyway;
    and an emptyDir of medium Memory becomes a hostPath of a new world-writable directory in the
    host's /dev/shm: podman 4.3 makes it a root-owned 0755 directory on disk, where a kubelet
    mounts a tmpfs any container user may write (as every emptyDir is)."""
    body = json.loads(json.dumps(obj))
    meta = body["spec"]["template"]["metadata"] if body["kind"] == "Deployment" else body["metadata"]
    meta.setdefault("labels", {})[E2E_LABEL] = "1"
    pod_spec = body["spec"]["template"]["spec"] if body["kind"] == "Deployment" else body["spec"]
    for c in pod_spec["containers"]:
        c.pop("ports", None)
    memory_dirs = []
    for v in pod_spec.get("volumes") or []:
        if (v.get("emptyDir") or {}).get("medium") == "Memory":
            d = Path(tempfile.mkdtemp(prefix="kubetrt-e2e-", dir="/dev/shm"))
            d.chmod(0o1777)
            memory_dirs.append(d)
            v.pop("emptyDir")
            v["hostPath"] = {"path": str(d), "type": "Directory"}
    path = workdir / f"{body['kind'].lower()}-{body['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    podman("kube", "down", str(path), check=False)
    podman("kube", "play", "--network", "host", str(path), timeout=300)
    pod = f"{body['metadata']['name']}-pod-0" if body["kind"] == "Deployment" else body["metadata"]["name"]
    return Played(path, pod, {c["name"]: f"{pod}-{c['name']}" for c in pod_spec["containers"]}, tuple(memory_dirs))


# ----------------------------------------------------------------------------- waiting
def wait_http_ready(url: str, container: str, timeout: float = 180.0) -> float:
    """Poll `url` until it answers 200; fail early (with the log) if the container stops or restarts."""
    start = time.monotonic()
    restarts = inspect(container).get("RestartCount", 0)
    while time.monotonic() - start < timeout:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        state = inspect(container)
        if not state["State"]["Running"] or state.get("RestartCount", 0) != restarts:
            raise PodError(f"{container} stopped before {url} was ready (exit {state['State']['ExitCode']}); "
                           f"log tail:\n{logs(container)[-4000:]}")
        time.sleep(0.5)
    raise PodError(f"{url} not ready after {timeout:.0f}s; {container} log tail:\n{logs(container)[-4000:]}")


# ----------------------------------------------------------------------------- a sidecar's client
def assert_sidecar_infers_through_shared_memory(sidecar: str, server: str, model_name: str, model_version: str,
                                                inputs: Mapping[str, Any], expected: Mapping[str, Any],
                                                tolerance: float, shm_path: str) -> None:
    """Runs SHM_CLIENT in the `sidecar` container against the server at `server` (the pod's
    loopback): the input goes into the pod's shared memory, the server answers into it, and what
    the sidecar reads back from there must be `expected` (name -> array) within `tolerance`."""
    import base64

    import numpy as np

    request = {"server": server, "model": model_name, "version": model_version,
               "inputs": {n: [list(x.shape), base64.b64encode(np.asarray(x).astype("<f4").tobytes()).decode()]
                          for n, x in inputs.items()},
               "outputs": {n: int(np.asarray(ref).size) for n, ref in expected.items()}}
    proc = podman("exec", "-i", sidecar, "python", "-", json.dumps(request), stdin=SHM_CLIENT.read_text(), check=False)
    assert proc.returncode == 0, f"the sidecar's client failed:\n{proc.stderr[-3000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["name"] for r in got["status"]} == {f"in-{n}" for n in inputs} | {f"out-{n}" for n in expected}
    for out in got["answer"]:  # the answer names the region instead of carrying the data
        assert "data" not in out and out["parameters"]["shared_memory_region"] == f"out-{out['name']}", out
    for name, ref in sorted(expected.items()):
        ref = np.asarray(ref)
        read = np.asarray(got["read"][name], np.float32).reshape(ref.shape)
        err = float(np.max(np.abs(read.astype(np.float64) - ref)))
        print(f"sidecar through {shm_path}: output {name} shape {list(read.shape)} max abs error vs "
              f"TensorFlow {err:.2e} (tolerance {tolerance:g})", flush=True)
        np.testing.assert_allclose(read, ref, rtol=tolerance, atol=tolerance, err_msg=f"output {name}")
