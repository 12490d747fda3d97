"""The test kubelet itself: what a container sees is what the pod spec says (quick, no model)."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from kubetrt.operators import objects

import kubelet


def pod(tmp_path: Path, script: str, **container: Any) -> dict[str, Any]:
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    (store / "engine.json").write_text("{}")
    c = {"name": "main", "image": "x", "command": ["sh", "-c", script],
         "securityContext": {"readOnlyRootFilesystem": True},
         "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "FallbackToLogsOnError",
         "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": objects.CACHE_DIR},
                          {"name": "store", "mountPath": str(store), "readOnly": True}]}
    c.update(container)
    return {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [c], "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
                                                    {"name": "store", "hostPath": {"path": str(store),
                                                                                  "type": "Directory"}}]}}


def test_mounts_are_the_pod_specs_and_the_root_is_read_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    parent = os.path.dirname(objects.CACHE_DIR)
    beside = " && ".join(f"test -e {parent}/{n}" for n in os.listdir(parent)) if os.path.isdir(parent) else "true"
    script = f"""
        touch /tmp/a {objects.CACHE_DIR}/b
        test -f {store}/engine.json
        ! touch {store}/x 2>/dev/null
        ! touch /etc/kubelet-test 2>/dev/null
        {beside or "true"}
        test -c /dev/null && test -c /dev/urandom && test -d /dev/shm
        echo -n written > /dev/termination-log
    """
    result = kubelet.run(pod(tmp_path, script), timeout=30)
    assert (result.exit_code, result.message) == (0, "written"), result.describe()
    assert not os.path.exists(objects.CACHE_DIR), "mount points are made inside the namespace, not on the host"
    assert not (store / "x").exists() and not os.path.exists("/etc/kubelet-test")


def test_env_is_the_images_plus_the_pod_specs_with_the_cpu_allowance_rounded_up(tmp_path: Path) -> None:
    env = [{"name": "HOME", "value": "/tmp"}, *objects._thread_env("main", {"requests": {"cpu": "500m"}}),
           {"name": "WHO", "value": "$(HOSTNAME)-x"}]
    c = {"name": "main", "resources": {"requests": {"cpu": "500m"}}, "env": env}
    got = kubelet.container_env(c, "pod-1", "ns")
    assert got == {**kubelet.IMAGE_ENV, "HOSTNAME": "pod-1", "HOME": "/tmp", "OMP_NUM_THREADS": "1",
                   "KUBETRT_THREADS": "1", "KUBETRT_JIT_THREADS": "1", "WHO": "pod-1-x"}
    limited = {"name": "main", "resources": {"limits": {"cpu": "2500m"}, "requests": {"cpu": "1"}},
               "env": objects._thread_env("main", {"limits": {"cpu": "2500m"}})}
    assert kubelet.container_env(limited, "p", "ns")["OMP_NUM_THREADS"] == "3"
    no_limit = {"name": "main", "env": [{"name": "N", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]}
    assert kubelet.container_env(no_limit, "p", "ns")["N"] == str(os.cpu_count()), "node allocatable"

    result = kubelet.run(pod(tmp_path, "env | sort > /dev/termination-log", env=env,
                             resources={"requests": {"cpu": "500m"}}), timeout=30, pod_name="pod-1")
    seen = dict(line.split("=", 1) for line in result.message.splitlines())
    seen.pop("PWD", None)  # the shell of the test command itself adds it
    assert seen == got


def test_a_failure_without_a_message_reports_the_log_tail(tmp_path: Path) -> None:
    script = "for i in $(seq 1 100); do echo line $i; done; exit 3"
    result = kubelet.run(pod(tmp_path, script), timeout=30)
    assert result.exit_code == 3
    assert result.message.splitlines() == [f"line {i}" for i in range(21, 101)]
    plain = kubelet.run(pod(tmp_path, script, terminationMessagePolicy="File"), timeout=30)
    assert plain.message == ""


def test_a_busy_container_port_fails_the_start_clearly(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        spec = pod(tmp_path, "true", ports=[{"name": "http", "containerPort": port}])
        with pytest.raises(kubelet.KubeletError, match=f"port {port}.*busy"):
            kubelet.start(spec)
