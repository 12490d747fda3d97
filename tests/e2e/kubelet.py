"""A small, honest "kubelet" for tests: one container of an operator-generated pod spec as a local process.

What it does as a kubelet (and container runtime) would, for the parts kubetrt's pods use:

* command + args exactly as generated; only a leading ``kubetrt`` executable (the images'
  console script, see docker/*.Dockerfile) is resolved to the dev venv's ``kubetrt`` script;
* env exactly as generated on top of the images' own env (PATH, PYTHONUNBUFFERED, HOME), with
  ``valueFrom.resourceFieldRef`` resolved like the Downward API (a missing cpu limit is the
  node's allocatable CPUs; values are rounded up to the divisor) and ``envFrom`` secrets taken
  from the ``secrets`` given (a missing secret fails the container, as CreateContainerConfigError);
* volumes at their mountPaths in a private mount namespace (``unshare --mount``): a fresh
  directory (0777) or tmpfs (medium Memory) per emptyDir, hostPath directories at their mount
  path (read-only where the mount says so), parent mount points created like runc does, a
  private /dev with the standard device nodes, ``readOnlyRootFilesystem`` honoured;
* the termination message: the file at ``terminationMessagePath`` (capped at 4096 bytes), or
  with FallbackToLogsOnError, on failure and an empty file, the log's last 80 lines / 2048 bytes;
* containerPorts: the process shares the host network, so a busy port fails the start loudly.

Not emulated (said here so nobody assumes it): runAsUser/runAsGroup/fsGroup, capabilities,
seccomp, resource limits (cgroups), probes, restarts, a network namespace.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import downward_api
from downward_api import expand as _expand

# Env the serving and builder images set (docker/serving.Dockerfile, docker/builder.Dockerfile):
# ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp. /opt/kubetrt/bin is the image's
# venv; here the dev venv's bin directory stands in for it.
VENV_BIN = str(Path(sys.executable).parent)
IMAGE_ENV = {
    "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",
}
IMAGE_WORKDIR = "/"  # the images' final WORKDIR
# What stands in for the image's /opt/kubetrt: the checkout (an editable install) and its venv.
IMAGE_PATHS = sorted({str(Path(__file__).resolve().parents[2]), sys.prefix}, key=len)

# kubelet's limits (pkg/kubelet/container: MaxContainerTerminationMessage{Length,LogLines,LogLength}).
MESSAGE_MAX_BYTES = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
DEFAULT_GRACE_SECONDS = 30
# What runc puts into a container's /dev (bind-mounted from the host here; no mknod needed).
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}
# Never shadowed by a tmpfs to create a missing mount point under them.
UNSHADOWABLE = {"/", "/proc", "/sys", "/dev", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/var", "/home",
                "/root", "/run", "/tmp", "/opt", "/srv", "/mnt", "/work"}


class KubeletError(RuntimeError):
    """The pod spec cannot be run here (unsupported volume, busy port, no mount namespaces...)."""


@dataclass(frozen=True)
class Terminated:
    """The container's terminated state, as the kubelet would report it."""

    exit_code: int
    message: str
    log: str
    signal: int | None = None

    @property
    def reason(self) -> str:
        return "Completed" if self.exit_code == 0 else "Error"

    def describe(self) -> str:
        return f"exit {self.exit_code}{f' (signal {self.signal})' if self.signal else ''}; log:\n{self.log[-6000:]}"


# ----------------------------------------------------------------------------- quantities / env
def container_env(container: Mapping[str, Any], pod_name: str, namespace: str,
                  secrets: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, str]:
    """The process environment: the image's env, HOSTNAME, envFrom, then env in order."""
    try:
        return downward_api.container_env(container, pod_name, namespace, dict(IMAGE_ENV, HOSTNAME=pod_name), secrets)
    except ValueError as e:
        raise KubeletError(str(e)) from None


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args (with $(VAR) expansion); a leading `kubetrt` is the dev venv's console script."""
    command = [_expand(str(c), env) for c in container.get("command") or []]
    args = [_expand(str(a), env) for a in container.get("args") or []]
    if not command:
        raise KubeletError(f"container {container['name']}: no command (the image's ENTRYPOINT is not known here)")
    argv = command + args
    if argv[0] == "kubetrt":
        script = shutil.which("kubetrt", path=VENV_BIN)
        argv[:1] = [script] if script else [sys.executable, "-m", "kubetrt.cli"]
    return argv


# ----------------------------------------------------------------------------- mounts
def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _depth(path: str) -> int:
    return len(PurePosixPath(path).parts)


def mount_namespace_command() -> list[str]:
    """unshare for a private mount namespace: as root directly, else inside a user namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise KubeletError("unshare (util-linux) is not installed; the test kubelet needs mount namespaces")
    if os.geteuid() == 0:
        return [unshare, "--mount", "--propagation", "private"]
    return [unshare, "--map-root-user", "--mount", "--propagation", "private"]


def mount_namespaces_work() -> str | None:
    """None if a private mount namespace with tmpfs and bind mounts works here, else why not."""
    try:
        cmd = mount_namespace_command()
    except KubeletError as e:
        return str(e)
    probe = "d=$(mktemp -d) && mount -t tmpfs tmpfs \"$d\" && mount --bind /proc \"$d\" && umount \"$d\""
    try:
        res = subprocess.run([*cmd, "sh", "-c", probe], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(cmd)} failed: {e}"
    return None if res.returncode == 0 else f"{' '.join(cmd)} failed: {res.stderr.strip() or res.returncode}"


class _Script:
    """The shell prologue that builds the container's mount view, then execs the command."""

    def __init__(self) -> None:
        self.lines = ["set -eu"]

    def run(self, *words: str) -> None:
        self.lines.append(" ".join(shlex.quote(w) for w in words))

    def text(self) -> str:
        return "\n".join([*self.lines, 'exec "$@"']) + "\n"


@dataclass
class _PodDir:
    root: Path
    stage: Path = field(init=False)
    volumes: Path = field(init=False)

    def __post_init__(self) -> None:
        self.stage = self.root / "stage"
        self.volumes = self.root / "volumes"
        self.stage.mkdir()
        self.volumes.mkdir()


def _pod_dir_base(covered: list[str]) -> Path:
    """Where the pod's own directories live on the host: nowhere a mount of the pod covers."""
    for base in (os.environ.get("KUBETRT_TEST_KUBELET_DIR"), "/var/tmp", tempfile.gettempdir()):
        if base and os.path.isdir(base) and not any(_under(base, c) for c in covered):
            return Path(base)
    raise KubeletError(f"no directory for the pod's volumes outside what its mounts cover: {covered}")


def _plan_mounts(pod_spec: Mapping[str, Any], container: Mapping[str, Any], term_path: str | None,
                 pod_name: str) -> tuple[str, Path]:
    """The prologue script and the host path of the termination message file."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    mounts = sorted(container.get("volumeMounts") or [], key=lambda m: _depth(m["mountPath"]))
    mount_paths = [m["mountPath"] for m in mounts]
    for m in mounts:
        if not m["mountPath"].startswith("/"):
            raise KubeletError(f"mountPath {m['mountPath']!r} is not absolute")
        if m["name"] not in volumes:
            raise KubeletError(f"volumeMount {m['name']!r} names no volume of the pod")
        if m.get("mountPropagation") not in (None, "None"):
            raise KubeletError(f"mountPropagation {m['mountPropagation']} is not supported")

    # Mount points that do not exist on the host: created inside a volume mounted earlier, or
    # (outside every volume) on a tmpfs over their nearest existing ancestor, with that
    # ancestor's entries bound back so the rest of the "image" stays visible.
    shadows: list[str] = []
    needed = list(mount_paths)
    if term_path:
        needed.append(term_path if not _under(term_path, "/dev") else "/dev")
    for path in needed:
        if os.path.lexists(path) or any(_under(path, earlier) for earlier in mount_paths if earlier != path
                                        and _depth(earlier) < _depth(path)):
            continue
        ancestor = str(PurePosixPath(path).parent)
        while not os.path.isdir(ancestor):
            ancestor = str(PurePosixPath(ancestor).parent)
        if ancestor in UNSHADOWABLE:
            raise KubeletError(f"mount point {path} does not exist and its parent {ancestor} cannot be shadowed")
        if ancestor not in shadows:
            shadows.append(ancestor)
    for needs in [sys.prefix, sys.base_prefix, os.getcwd()]:
        for s in shadows:
            if _under(needs, s):
                raise KubeletError(f"creating mount points under {s} would hide {needs}")

    covered = mount_paths + shadows + (["/dev"] if term_path and _under(term_path, "/dev") else [])
    pod = _PodDir(Path(tempfile.mkdtemp(prefix=f"kubelet-{pod_name}-", dir=_pod_dir_base(covered))))
    sh = _Script()
    # 1. Stage everything a later mount covers (host paths, /dev, shadowed directories).
    staged: dict[str, Path] = {}

    def stage(host_path: str, tag: str) -> Path:
        if host_path not in staged:
            dest = pod.stage / f"{len(staged)}-{tag}"
            dest.mkdir()
            sh.run("mount", "--rbind", host_path, str(dest))
            staged[host_path] = dest
        return staged[host_path]

    for m in mounts:
        vol = volumes[m["name"]]
        if "hostPath" in vol:
            hp = vol["hostPath"]
            typ = hp.get("type") or ""
            if typ == "Directory" and not os.path.isdir(hp["path"]):
                raise KubeletError(f"hostPath {hp['path']} (type Directory) does not exist on this node")
            if typ == "DirectoryOrCreate":
                os.makedirs(hp["path"], mode=0o755, exist_ok=True)
            if typ not in ("", "Directory", "DirectoryOrCreate"):
                raise KubeletError(f"hostPath type {typ} is not supported")
            stage(hp["path"], m["name"])
        elif "emptyDir" in vol:
            d = pod.volumes / m["name"]
            if not d.exists():
                d.mkdir()
                d.chmod(0o777)  # the kubelet makes emptyDirs world-writable
        else:
            kinds = sorted(set(vol) - {"name"})
            raise KubeletError(f"volume {m['name']}: only emptyDir and hostPath are supported, not {kinds}")
    shadow_entries: dict[str, list[os.DirEntry[str]]] = {}
    for s in shadows:
        stage(s, "shadow")
        shadow_entries[s] = list(os.scandir(s))
    dev_stage = stage("/dev", "dev") if term_path and _under(term_path, "/dev") else None
    image_stage = {path: stage(path, "image") for path in IMAGE_PATHS if any(_under(path, c) for c in mount_paths)}

    # 2. Build the view, parents before children (as containerd sorts mounts).
    for s in shadows:
        sh.run("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", s)
        for e in shadow_entries[s]:
            dest, src = f"{s}/{e.name}", str(staged[s] / e.name)
            if e.is_symlink():
                sh.run("ln", "-s", os.readlink(e.path), dest)
            elif e.is_dir():
                sh.run("mkdir", dest)
                sh.run("mount", "--rbind", src, dest)
            else:
                sh.run("touch", dest)
                sh.run("mount", "--bind", src, dest)
    if dev_stage is not None:
        sh.run("mount", "-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs", "/dev")
        for node in DEV_NODES:
            if os.path.exists(f"/dev/{node}"):
                sh.run("touch", f"/dev/{node}")
                sh.run("mount", "--bind", str(dev_stage / node), f"/dev/{node}")
        for link, target in DEV_LINKS.items():
            sh.run("ln", "-s", target, f"/dev/{link}")
        sh.run("mkdir", "/dev/shm", "/dev/pts", "/dev/mqueue")
        sh.run("mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "shm", "/dev/shm")
        if os.path.isdir("/dev/pts"):
            sh.run("mount", "--rbind", str(dev_stage / "pts"), "/dev/pts")
    for m in mounts:
        vol, path = volumes[m["name"]], m["mountPath"]
        sh.run("mkdir", "-p", path)
        if "hostPath" in vol:
            src = staged[vol["hostPath"]["path"]]
            if m.get("subPath"):
                src = src / m["subPath"]
            sh.run("mount", "--rbind", str(src), path)
            if m.get("readOnly"):
                sh.run("mount", "-o", "remount,bind,ro", path)
        else:
            src = pod.volumes / m["name"]
            if vol["emptyDir"].get("medium") == "Memory":
                sh.run("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(src))
            sh.run("mount", "--bind", str(src / m.get("subPath", "")), path)
            if m.get("readOnly"):
                sh.run("mount", "-o", "remount,bind,ro", path)

    # The "image": in a real pod the code lives in the image (/opt/kubetrt); here it is this
    # checkout and its venv, which a volume (an emptyDir at /tmp, say) may cover. Bound back on top.
    for path in IMAGE_PATHS:
        if any(_under(path, c) for c in mount_paths):
            sh.run("mkdir", "-p", path)
            sh.run("mount", "--rbind", str(image_stage[path]), path)

    # 3. The termination message file: a host file bind-mounted at terminationMessagePath.
    host_term = pod.root / "termination-log"
    host_term.touch()
    host_term.chmod(0o666)  # the kubelet makes it writable for any container user
    if term_path:
        sh.run("mkdir", "-p", str(PurePosixPath(term_path).parent))
        sh.run("touch", term_path)
        sh.run("mount", "--bind", str(host_term), term_path)

    # 4. readOnlyRootFilesystem: the root and the stand-ins for image directories become read-only.
    if (container.get("securityContext") or {}).get("readOnlyRootFilesystem"):
        sh.run("mount", "-o", "remount,bind,ro", "/")
        for s in shadows:
            sh.run("mount", "-o", "remount,ro", s)
            for e in shadow_entries[s]:
                if not e.is_symlink():
                    sh.run("mount", "-o", "remount,bind,ro", f"{s}/{e.name}")
    sh.run("cd", container.get("workingDir") or IMAGE_WORKDIR)
    sh.lines.append("unset OLDPWD PWD")  # the prologue's own cd is not part of the container's env
    (pod.root / "prologue.sh").write_text(sh.text())
    return str(pod.root), host_term


# ----------------------------------------------------------------------------- running
def _check_ports_free(container: Mapping[str, Any]) -> None:
    for port in container.get("ports") or []:
        number = int(port["containerPort"])
        proto = socket.SOCK_DGRAM if port.get("protocol") == "UDP" else socket.SOCK_STREAM
        with socket.socket(socket.AF_INET, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                s.bind(("0.0.0.0", number))
            except OSError as e:
                raise KubeletError(
                    f"container {container['name']} wants port {number} ({port.get('name', '')}), which is busy on "
                    f"this machine ({e.strerror}); pods share the host network here, so stop whatever listens on "
                    f"{number} (e.g. `ss -ltnp 'sport = :{number}'`)") from None


class Container:
    """A started container: wait() for its terminated state, stop() like a pod deletion, kill()."""

    def __init__(self, proc: subprocess.Popen[bytes], pod_dir: Path, log_path: Path, term_host: Path,
                 container: Mapping[str, Any], grace: float) -> None:
        self.proc, self.pod_dir, self.log_path, self.term_host = proc, pod_dir, log_path, term_host
        self.spec = container
        self.grace = grace
        self.name = container["name"]
        self._result: Terminated | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait(self, timeout: float | None = None) -> Terminated:
        """Wait for the process (killing it after ``timeout``) and report its terminated state."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise KubeletError(f"container {self.name} ran longer than {timeout}s; killed. Log:\n{self.log()[-4000:]}")
        return self._terminated()

    def kill(self) -> Terminated:
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return self._terminated()

    def stop(self, grace: float | None = None) -> Terminated:
        """SIGTERM, then SIGKILL after the grace period (terminationGracePeriodSeconds)."""
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace if grace is None else grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self._terminated()

    def _terminated(self) -> Terminated:
        if self._result is not None:
            return self._result
        rc = self.proc.returncode
        code, sig = (128 - rc, -rc) if rc < 0 else (rc, None)
        log = self.log()
        with open(self.term_host, "rb") as f:
            message = f.read(MESSAGE_MAX_BYTES).decode(errors="replace")
        if (not message.strip() and code != 0
                and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"):
            tail = "\n".join(log.splitlines()[-FALLBACK_LOG_LINES:])
            message = tail.encode()[-FALLBACK_LOG_BYTES:].decode(errors="replace")
        self._result = Terminated(code, message, log, sig)
        self.cleanup()
        return self._result

    def cleanup(self) -> None:
        """Remove the pod's host directories once the process (and so its namespace) is gone."""
        if not self.running():
            shutil.rmtree(self.pod_dir, ignore_errors=True)


_started: list[Container] = []


def stop_all(grace: float = 5.0) -> list[str]:
    """Stop every container this kubelet started that still runs (a test's safety net); their names."""
    left = [c for c in _started if c.running()]
    for c in left:
        c.stop(grace)
    _started.clear()
    return [c.name for c in left]


def pod_spec_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod spec of a Pod, or of a Job's / Deployment's template."""
    if obj.get("kind") == "Pod":
        return obj["spec"]
    return obj["spec"]["template"]["spec"]


def start(obj: Mapping[str, Any], container_name: str | None = None, *, pod_name: str | None = None,
          secrets: Mapping[str, Mapping[str, str]] | None = None) -> Container:
    """Start one container of a Pod / Job / Deployment as a local process in its own mount namespace."""
    spec = pod_spec_of(obj)
    containers = spec["containers"]
    container = (containers[0] if container_name is None
                 else next((c for c in containers if c["name"] == container_name), None))
    if container is None:
        raise KubeletError(f"no container {container_name!r} in {[c['name'] for c in containers]}")
    meta = obj.get("metadata") or {}
    pod_name = pod_name or f"{meta.get('name', 'pod')}-{os.urandom(3).hex()}"
    env = container_env(container, pod_name, meta.get("namespace", "default"), secrets)
    argv = container_argv(container, env)
    _check_ports_free(container)
    term_path = container.get("terminationMessagePath", DEFAULT_TERMINATION_PATH)
    pod_dir, term_host = _plan_mounts(spec, container, term_path, pod_name)
    root = Path(pod_dir)
    log_path = root / "container.log"
    namespace = mount_namespace_command()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([*namespace, "/bin/sh", str(root / "prologue.sh"), *argv], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    grace = float(spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
    started = Container(proc, root, log_path, term_host, container, grace)
    _started.append(started)
    return started


def run(obj: Mapping[str, Any], container_name: str | None = None, *, timeout: float = 300.0,
        pod_name: str | None = None, secrets: Mapping[str, Mapping[str, str]] | None = None) -> Terminated:
    """Run one container to completion and return its terminated state."""
    return start(obj, container_name, pod_name=pod_name, secrets=secrets).wait(timeout)


def wait_http_ready(c: Container, url: str, timeout: float = 60.0) -> None:
    """Play the readiness probe: poll ``url`` until it answers 200 (fail early if the process exits)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if not c.running():
            raise KubeletError(f"container {c.name} exited before it was ready: {c.wait().describe()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
                last = resp.status
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.1)
    raise KubeletError(f"{url} not ready within {timeout}s (last: {last!r}); log:\n{c.log()[-4000:]}")
