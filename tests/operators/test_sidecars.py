"""spec.sidecars and spec.sharedMemory on the serving pods: the sidecars beside the serving
container, the in-memory /dev/shm they share with it, and `kubetrt serve --shared-memory`."""
from __future__ import annotations

from typing import Any

from kubetrt.operators import crds, names, objects

from operator_testlib import md_body
from test_pod_settings import built

CLIENT = {"name": "preprocess", "image": "corp/preprocess:3", "args": ["--model", "resnet"],
          "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
SHM = {"name": names.SHARED_MEMORY_VOLUME, "mountPath": names.SHARED_MEMORY_PATH}


def serving_pods(**spec: Any) -> dict[str, dict[str, Any]]:
    return built(md_body(**spec))[1]


def command(pod: dict[str, Any]) -> list[str]:
    return pod["containers"][0]["command"]


def test_shared_memory_turns_the_extension_on_and_mounts_one_dev_shm_in_every_container() -> None:
    pods = serving_pods(sharedMemory={"sizeLimit": "2Gi"}, sidecars=[CLIENT])
    assert set(pods) == {"h100", "t4", "cpu"}
    for target, pod in pods.items():
        serving, sidecar = pod["containers"]
        assert serving["name"] == names.SERVING_CONTAINER and "--shared-memory" in serving["command"], target
        assert [v for v in pod["volumes"] if v["name"] == names.SHARED_MEMORY_VOLUME] == [
            {"name": names.SHARED_MEMORY_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}], target
        assert SHM in serving["volumeMounts"] and sidecar["volumeMounts"] == [SHM], target


def test_shared_memory_defaults_to_a_gibibyte_and_needs_no_sidecar() -> None:
    pod = serving_pods(sharedMemory={})["cpu"]
    assert len(pod["containers"]) == 1 and "--shared-memory" in command(pod)
    shm = [v for v in pod["volumes"] if v["name"] == names.SHARED_MEMORY_VOLUME]
    assert shm[0]["emptyDir"]["sizeLimit"] == crds.DEFAULT_SHARED_MEMORY_SIZE == "1Gi"


def test_without_shared_memory_the_server_keeps_it_off_and_sidecars_get_no_dev_shm() -> None:
    pod = serving_pods(sidecars=[CLIENT])["cpu"]
    assert "--shared-memory" not in command(pod)
    assert all(v["name"] != names.SHARED_MEMORY_VOLUME for v in pod["volumes"])
    assert all(m["mountPath"] != names.SHARED_MEMORY_PATH for m in pod["containers"][0]["volumeMounts"])
    assert "volumeMounts" not in pod["containers"][1]


def test_a_sidecar_keeps_what_the_user_wrote_and_gets_the_restricted_defaults_it_left_out() -> None:
    own = {**CLIENT, "name": "own", "securityContext": {"allowPrivilegeEscalation": True, "runAsUser": 1000}}
    pod = serving_pods(sidecars=[CLIENT, own])["cpu"]
    assert [c["name"] for c in pod["containers"]] == [names.SERVING_CONTAINER, "preprocess", "own"]
    client, mine = pod["containers"][1:]
    assert {k: client[k] for k in CLIENT} == CLIENT
    assert client["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert mine["securityContext"] == {"allowPrivilegeEscalation": True, "runAsUser": 1000,
                                       "capabilities": {"drop": ["ALL"]}}
    assert CLIENT.get("securityContext") is None, "the spec's own sidecar is left as it was"


def test_the_operator_refuses_what_the_crds_rules_refuse() -> None:
    def errors(sidecars: list[dict[str, Any]]) -> list[str]:
        return objects.validate_spec(objects.normalized_spec(md_body(sidecars=sidecars)))

    assert errors([CLIENT]) == []
    assert errors([{**CLIENT, "name": names.SERVING_CONTAINER}]) == [crds.SIDECAR_NAME_TAKEN]
    assert errors([CLIENT, {**CLIENT, "image": "other:1"}]) == ["spec.sidecars: duplicate names: preprocess"]
    assert errors([{**CLIENT, "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}]) == [crds.SIDECAR_OWN_VOLUMES]
