"""Safe rollouts on a real control plane, with the chart's operator: a new model version as a canary
revision beside the stable one (its own Deployment, behind the same Service, its share carried by
replica counts), then promoted, under a client querying throughout that sees no failed request.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from kube_cluster import Release, kubectl, kubectl_json, say, wait_until
from kubetrt.operators import names, rollout
from node_agent import NodeAgent
from test_workflow import NS, Client, Flow, _dump, _pod_ready, ready, serving_pods

pytestmark = pytest.mark.cluster

NAME = "rollout-cnn"


def show(flow: Flow, what: str) -> dict[str, Any]:
    """Print `kubectl get modeldeployment -o wide` and status.revisions (they belong in the log)."""
    wide = kubectl("get", "modeldeployment", flow.name, "-n", NS, "-o", "wide").stdout
    st = flow.get().get("status") or {}
    print(f"\n--- {what}\n$ kubectl get modeldeployment {flow.name} -o wide\n{wide}"
          f"status.revisions: {json.dumps(st.get('revisions'), indent=1)}", flush=True)
    return st


def _deployments(flow: Flow) -> dict[str, dict[str, Any]]:
    items = kubectl_json("get", "deployments", "-n", NS, "-l", f"{names.LABEL_MD}={flow.name}")["items"]
    return {d["metadata"]["name"]: d for d in items}


def _ready_revisions(flow: Flow) -> dict[str, int]:
    out: dict[str, int] = {}
    for pod in serving_pods(flow):
        if _pod_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
            rev = pod["metadata"]["labels"][names.LABEL_REVISION]
            out[rev] = out.get(rev, 0) + 1
    return out


@pytest.fixture(scope="module")
def canary_flow(model: Any, release: Release, agent: NodeAgent, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Flow]:
    md = model.model_deployment()
    md["metadata"] = {"name": NAME, "namespace": NS}
    md["spec"]["rollout"] = {"canaryTrafficPercent": 50}
    (target,) = md["spec"]["targets"]
    target["replicas"] = 1
    path = tmp_path_factory.mktemp("rollout") / "modeldeployment.yaml"
    path.write_text(yaml.safe_dump(md, sort_keys=False))
    flow = Flow(md, path, NAME, target["name"], {})
    say(f"kubectl apply -f modeldeployment.yaml ({NAME}: canaryTrafficPercent 50, one replica)")
    kubectl("apply", "-f", str(path))
    wait_until(f"{NAME} Ready", lambda: ready(flow), timeout=420, period=2, detail=lambda: _dump(flow, agent))
    yield flow
    kubectl("delete", "modeldeployment", NAME, "-n", NS, "--wait=true", "--timeout=120s", check=False, timeout=180)
    wait_until(f"the objects of {NAME} deleted", lambda: not kubectl(
        "get", "deployment,pod,enginebuild", "-n", NS, "-l", f"{names.LABEL_MD}={NAME}", "-o", "name").stdout.split(),
        timeout=180, period=1)


def _patch(flow: Flow, spec: dict[str, Any]) -> None:
    kubectl("patch", "modeldeployment", flow.name, "-n", NS, "--type=merge", "-p", json.dumps({"spec": spec}))


def test_canary_revision_beside_the_stable_one_then_promoted_with_no_failed_request(
        canary_flow: Flow, model: Any, agent: NodeAgent) -> None:
    flow = canary_flow
    v1 = show(flow, "version 1 serving")["currentRevision"]
    assert v1.startswith("v1-"), v1
    stable = f"{NAME}-{flow.cpu_target}"
    with Client(flow, model) as client:
        time.sleep(2)
        say("model version 1 -> 2 with canaryTrafficPercent 50, under a querying client")
        _patch(flow, {"model": {"version": "2"}})

        def side_by_side() -> dict[str, int] | None:
            revs = _ready_revisions(flow)
            st = flow.get().get("status") or {}
            if len(revs) == 2 and st.get("canaryRevision", "-") in revs and ready(flow):
                return revs
            return None
        revs = wait_until("version 2's canary ready beside version 1", side_by_side, timeout=300, period=1,
                          detail=lambda: _dump(flow, agent))
        st = show(flow, "canary at 50%: two revisions side by side")
        v2 = st["canaryRevision"]
        assert v2.startswith("v2-") and st["currentRevision"] == v1 and revs == {v1: 1, v2: 1}
        deps = _deployments(flow)
        assert sorted(deps) == sorted([stable, names.canary_name(stable)])
        assert rollout.deployment_revision(deps[stable]) == v1
        assert rollout.deployment_revision(deps[names.canary_name(stable)]) == v2
        by_name = {r["name"]: r for r in st["revisions"]}
        assert (by_name[v1]["role"], by_name[v1]["modelVersion"], by_name[v1]["trafficPercent"]) == ("stable", "1", 50)
        assert (by_name[v2]["role"], by_name[v2]["modelVersion"], by_name[v2]["trafficPercent"]) == ("canary", "2", 50)
        svc = kubectl_json("get", "service", NAME, "-n", NS)["spec"]["selector"]
        assert names.LABEL_REVISION not in svc and names.LABEL_TRACK not in svc, "the Service selects both revisions"
        time.sleep(3)
        reached = set(client.addresses)

        say("canaryTrafficPercent 50 -> 100: promotion")
        _patch(flow, {"rollout": {"canaryTrafficPercent": 100}})

        def promoted() -> bool:
            st = flow.get().get("status") or {}
            return (st.get("currentRevision") == v2 and st.get("canaryRevision") == "-" and bool(ready(flow))
                    and sorted(_deployments(flow)) == [stable] and _ready_revisions(flow) == {v2: 1}
                    and len(serving_pods(flow)) == 1)
        wait_until("version 2 promoted, version 1 removed", promoted, timeout=300, period=1,
                   detail=lambda: _dump(flow, agent))
        time.sleep(2)
    st = show(flow, "promoted: one revision")
    assert [(r["name"], r["role"], r["trafficPercent"]) for r in st["revisions"]] == [(v2, "stable", 100)]
    say(f"canary and promotion: {client.ok} requests answered, {len(client.failures)} failed, "
        f"{len(client.addresses)} pod addresses reached")
    assert len(reached) >= 2, f"the client never reached both revisions: {reached}"
    assert client.failures == [], client.failures[:10]
