"""Safe rollouts on a real control plane, with the chart's operator: a new model version as a canary
revision beside the stable one (its own Deployment, behind the same Service, its share carried by
replica counts), then promoted, under a client querying throughout that sees no failed request;
a canary analysis (the canary pods' /metrics read through the API server's pod proxy) promoting a
canary within bounds, rolling back one whose pods fail requests (serving's fault injection,
KUBETRT_FAULT_ERROR_RATE, set on the canary Deployment), and rolling back a revision whose engine
fails its golden check. The real CRDs of the Gateway API, KEDA and the Prometheus Operator
(upstream_crds.py) validate the HTTPRoute whose weights follow the canary, the ScaledObject that
replaces the HPA once KEDA's CRD is served, and the ServiceMonitor.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

import upstream_crds
from kube_cluster import Release, kubectl, kubectl_json, say, wait_until
from kubetrt.operators import names, rollout
from node_agent import NodeAgent
from test_workflow import NS, Client, Flow, _dump, _pod_ready, ready, serving_pods

pytestmark = pytest.mark.cluster

NAME = "rollout-cnn"
STABLE_SVC, CANARY_SVC = names.track_service_name(NAME, "stable"), names.track_service_name(NAME, "canary")
GATEWAY = {"name": "public", "namespace": NS, "sectionName": "http"}  # no Gateway controller here: not programmed


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
    md["spec"]["rollout"] = {"canaryTrafficPercent": 50, "gateway": dict(GATEWAY)}
    (target,) = md["spec"]["targets"]
    target["replicas"] = 1
    path = tmp_path_factory.mktemp("rollout") / "modeldeployment.yaml"
    path.write_text(yaml.safe_dump(md, sort_keys=False))
    flow = Flow(md, path, NAME, target["name"], {})
    upstream_crds.install(upstream_crds.HTTP_ROUTE)
    say(f"kubectl apply -f modeldeployment.yaml ({NAME}: canaryTrafficPercent 50, one replica, gateway {GATEWAY})")
    kubectl("apply", "-f", str(path))
    wait_until(f"{NAME} Ready", lambda: ready(flow), timeout=420, period=2, detail=lambda: _dump(flow, agent))
    # The operator asks API discovery again a minute after it last did: any sync then makes the route.
    wait_until("the HTTPRoute of the ModelDeployment, to the stable track only",
               lambda: _poke(flow) or route_weights() == {STABLE_SVC: 100}, timeout=150, period=5,
               detail=lambda: _dump(flow, agent))
    yield flow
    kubectl("delete", "modeldeployment", NAME, "-n", NS, "--wait=true", "--timeout=120s", check=False, timeout=180)
    wait_until(f"the objects of {NAME} deleted", lambda: not kubectl(
        "get", "deployment,pod,enginebuild", "-n", NS, "-l", f"{names.LABEL_MD}={NAME}", "-o", "name").stdout.split(),
        timeout=180, period=1)


def _poke(flow: Flow) -> None:
    """Make the operator sync the ModelDeployment now (a serving pod's event does)."""
    for pod in serving_pods(flow)[:1]:
        kubectl("annotate", "pod", pod["metadata"]["name"], "-n", NS, f"kubetrt.io/poke={time.time()}", "--overwrite",
                check=False)


def route_weights() -> dict[str, int] | None:
    """The HTTPRoute's backends and weights, as the API server stores it (None if absent)."""
    found = kubectl("get", "httproute", NAME, "-n", NS, "-o", "json", check=False)
    if found.returncode != 0:
        return None
    (rule,) = json.loads(found.stdout)["spec"]["rules"]
    return {b["name"]: b["weight"] for b in rule["backendRefs"]}


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
        weights = wait_until("the HTTPRoute's weights 50/50", lambda: route_weights() == {STABLE_SVC: 50, CANARY_SVC: 50}
                             and route_weights(), timeout=60)
        route = kubectl_json("get", "httproute", NAME, "-n", NS)
        say(f"HTTPRoute {NAME} during the canary: weights {weights}, parentRefs {route['spec']['parentRefs']}")
        assert route["spec"]["parentRefs"][0]["name"] == GATEWAY["name"]
        assert route["metadata"]["ownerReferences"][0]["name"] == NAME
        traffic = flow.get()["status"]["traffic"]
        say(f"status.traffic: {traffic}")
        assert (traffic["mechanism"], traffic["canaryWeight"]) == ("HTTPRoute", 50), traffic
        for track, svc_name in (("stable", STABLE_SVC), ("canary", CANARY_SVC)):
            endpoints = kubectl_json("get", "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={svc_name}")
            ips = {a for es in endpoints["items"] for e in es.get("endpoints") or [] for a in e["addresses"]}
            pods = {p["status"].get("podIP") for p in serving_pods(flow)
                    if p["metadata"]["labels"].get(names.LABEL_TRACK) == track}
            assert ips and ips <= pods, f"{svc_name} selects only its track's pods: {ips} vs {pods}"
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
    say(f"HTTPRoute {NAME} after the promotion: weights {route_weights()}")
    assert route_weights() == {STABLE_SVC: 100}
    say(f"canary and promotion: {client.ok} requests answered, {len(client.failures)} failed, "
        f"{len(client.addresses)} pod addresses reached")
    assert len(reached) >= 2, f"the client never reached both revisions: {reached}"
    assert client.failures == [], client.failures[:10]


# ----------------------------------------------------------------------------- canary analysis
ANALYSIS = {"windowSeconds": 20, "minRequests": 20, "maxErrorRate": 0.05, "maxP99Milliseconds": 5000}


def _events(flow: Flow, reason: str) -> list[dict[str, Any]]:
    items = kubectl_json("get", "events", "-n", NS, "--field-selector",
                         f"involvedObject.kind=ModelDeployment,involvedObject.name={flow.name}")["items"]
    return [e for e in items if e.get("reason") == reason]


def _settled(flow: Flow, rev: str) -> bool:
    """``rev`` is the only revision: stable, ready, one pod, no canary Deployment."""
    st = flow.get().get("status") or {}
    return (st.get("currentRevision") == rev and st.get("canaryRevision") == "-" and bool(ready(flow))
            and len(_deployments(flow)) == 1 and _ready_revisions(flow) == {rev: 1} and len(serving_pods(flow)) == 1)


def test_canary_within_its_analysis_bounds_is_promoted(canary_flow: Flow, model: Any, agent: NodeAgent) -> None:
    flow = canary_flow
    v2 = (flow.get().get("status") or {})["currentRevision"]
    with Client(flow, model) as client:
        time.sleep(1)
        say(f"version 2 -> 3 with canaryTrafficPercent 50 and canaryAnalysis {ANALYSIS}")
        _patch(flow, {"model": {"version": "3"}, "rollout": {"canaryTrafficPercent": 50, "canaryAnalysis": ANALYSIS}})
        wait_until("version 3's canary beside version 2", lambda: len(_ready_revisions(flow)) == 2, timeout=300,
                   period=1, detail=lambda: _dump(flow, agent))
        show(flow, "canary under analysis")
        wait_until("the canary promoted by its analysis", lambda: (flow.get().get("status") or {}).get(
            "promotedRevision", "").startswith("v3-"), timeout=240, period=1, detail=lambda: _dump(flow, agent))
        v3 = flow.get()["status"]["promotedRevision"]
        wait_until("version 3 the only revision", lambda: _settled(flow, v3), timeout=240, period=1,
                   detail=lambda: _dump(flow, agent))
        time.sleep(2)
    st = show(flow, "promoted by the canary analysis")
    assert st["canary"]["verdict"] == "Pass" and "canary held for 20s" in st["canary"]["message"], st["canary"]
    assert v3 != v2 and [r["name"] for r in st["revisions"]] == [v3]
    (event,) = [e for e in _events(flow, "Promoted") if v3 in e["message"]]
    say(f"Event {event['type']} Promoted: {event['message']}")
    say(f"analysis promotion: {client.ok} requests answered, {len(client.failures)} failed")
    assert client.failures == [], client.failures[:10]


def test_canary_failing_requests_is_rolled_back(canary_flow: Flow, model: Any, agent: NodeAgent) -> None:
    flow = canary_flow
    v3 = (flow.get().get("status") or {})["currentRevision"]
    canary = names.canary_name(f"{NAME}-{flow.cpu_target}")
    with Client(flow, model) as client:
        time.sleep(1)
        say("version 3 -> 4 (analysis window 600 s); its canary pods fail half their requests "
            "(KUBETRT_FAULT_ERROR_RATE=0.5 set on the canary Deployment)")
        _patch(flow, {"model": {"version": "4"}, "rollout": {"canaryAnalysis": {"windowSeconds": 600}}})
        wait_until("the canary Deployment", lambda: canary in _deployments(flow), timeout=300, period=1,
                   detail=lambda: _dump(flow, agent))
        kubectl("set", "env", f"deployment/{canary}", "-n", NS, "KUBETRT_FAULT_ERROR_RATE=0.5")
        seen_weights: list[dict[str, int] | None] = []

        def rolled_back() -> dict[str, Any] | None:
            seen_weights.append(route_weights())
            back = (flow.get().get("status") or {}).get("rolledBack") or {}
            return back if back.get("revision", "").startswith("v4-") else None
        back = wait_until("the canary rolled back", rolled_back, timeout=300, period=1,
                          detail=lambda: _dump(flow, agent))
        wait_until("version 3 the only revision again", lambda: _settled(flow, v3), timeout=120, period=1,
                   detail=lambda: _dump(flow, agent))
        failed_at_rollback = len(client.failures)
        time.sleep(3)
    st = show(flow, "rolled back on the canary's error rate")
    say(f"rolledBack: {back}")
    say(f"HTTPRoute {NAME} weights seen during the canary: {[w for i, w in enumerate(seen_weights) if w != seen_weights[i - 1] or not i]}; "
        f"after the rollback: {route_weights()}")
    assert {STABLE_SVC: 50, CANARY_SVC: 50} in seen_weights, "the route gave the ready canary its share"
    assert route_weights() == {STABLE_SVC: 100}, "rolled back: the route sends everything to the stable track"
    assert st["message"].startswith(f"revision {back['revision']} rolled back (ErrorRate): canary error rate"), st["message"]
    assert back["reason"] == "ErrorRate" and "over maxErrorRate 5.0%" in back["message"], back
    cond = next(c for c in st["conditions"] if c["type"] == "RolledBack")
    assert cond["status"] == "True" and cond["reason"] == "ErrorRate"
    (event,) = [e for e in _events(flow, "RolledBack") if back["revision"] in e["message"]]
    assert event["type"] == "Warning" and "error rate" in event["message"], event
    say(f"Event Warning RolledBack: {event['message']}")
    say(f"rollback: {client.ok} requests answered, {len(client.failures)} failed, all injected by the canary")
    assert all("injected fault" in f for f in client.failures), client.failures[:10]
    assert len(client.failures) == failed_at_rollback, "requests failed after the rollback"


def _bad_golden_package(model: Any) -> tuple[str, str]:
    """A copy of the model's package whose golden outputs are off (its manifest's file digest
    updated, so it reads as a consistent package), and an empty engine store (the model's digest
    leaves golden.npz out, so the old store would hand back the verified engine unbuilt): its
    engine builds, then fails verification."""
    import os

    import numpy as np

    from kubetrt.runtime import package as pkg

    bad, store = model.root / "package-bad-golden", model.root / "store-bad-golden"
    for path in (bad, store):
        shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(model.package_dir, bad)
    golden = bad / pkg.GOLDEN
    with np.load(golden, allow_pickle=False) as z:
        arrays = {k: (z[k] * 2 + 1 if ".output." in k else z[k]) for k in z.files}
    with open(golden, "wb") as f:
        np.savez(f, allow_pickle=False, **arrays)
    manifest = pkg.read_manifest(bad)
    manifest.files[pkg.GOLDEN] = pkg.sha256_file(golden)
    pkg.write_manifest(bad, manifest)
    store.mkdir()
    for p in [bad, *bad.rglob("*")]:
        p.chmod(p.stat().st_mode | (0o755 if p.is_dir() else 0o644))
    os.chown(store, 65532, 65532)  # the build Job's user publishes there (a PVC with fsGroup would allow it)
    return f"file://{bad}", f"file://{store}"


def test_a_revision_failing_its_golden_check_is_rolled_back(canary_flow: Flow, model: Any, agent: NodeAgent) -> None:
    flow = canary_flow
    v3 = (flow.get().get("status") or {})["currentRevision"]
    uri, store = _bad_golden_package(model)
    with Client(flow, model) as client:
        time.sleep(1)
        say(f"version 3 -> 5 from {uri} (engine store {store}), whose golden outputs the engine cannot match")
        _patch(flow, {"model": {"version": "5", "source": {"uri": uri}}, "store": {"uri": store}})
        started = time.monotonic()

        def rolled_back() -> dict[str, Any] | None:
            back = (flow.get().get("status") or {}).get("rolledBack") or {}
            return back if back.get("revision", "").startswith("v5-") else None
        back = wait_until("version 5 rolled back on its golden check", rolled_back, timeout=300, period=1,
                          detail=lambda: _dump(flow, agent))
        say(f"rolled back {time.monotonic() - started:.0f}s after the change (the build's first refusal, no retries)")
        time.sleep(3)
    st = show(flow, "rolled back on a failed golden check")
    say(f"rolledBack: {back}")
    assert back["reason"] == "GoldenCheckFailed" and "VerificationFailed" in back["message"], back
    assert _settled(flow, v3) and st["currentRevision"] == v3
    assert [e for e in _events(flow, "RolledBack") if back["revision"] in e["message"]]
    assert st["message"].startswith(f"revision {back['revision']} rolled back (GoldenCheckFailed)"), st["message"]
    say(f"golden-check rollback: {client.ok} requests answered, {len(client.failures)} failed")
    assert client.failures == [], client.failures[:10]

    def refused_job() -> dict[str, Any] | None:  # `kubetrt build` exits BUILD_REFUSED_EXIT_CODE on the refusal
        jobs = kubectl_json("get", "jobs", "-n", NS, "-l", f"{names.LABEL_MD}={flow.name}")["items"]
        return next((j for j in jobs if any(c.get("type") == "Failed" and c.get("reason") == "PodFailurePolicy"
                                            for c in (j.get("status") or {}).get("conditions") or [])), None)
    job = wait_until("the refused build's Job failed by its podFailurePolicy", refused_job, timeout=60, period=1,
                     detail=lambda: kubectl("get", "jobs", "-n", NS, "-o", "wide").stdout)
    assert job["status"].get("failed") == 1, job["status"]  # one pod: no retry built the refused engine again


# ----------------------------------------------------------------------------- autoscaling on load
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"  # the release's operator.prometheusURL (conftest)


def test_the_hpa_scales_on_the_chosen_metric_and_a_scaled_object_once_keda_is_there(canary_flow: Flow) -> None:
    hpa_name = f"{NAME}-{canary_flow.cpu_target}"

    def get(kind: str) -> dict[str, Any] | None:
        found = kubectl("get", kind, hpa_name, "-n", NS, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else None

    def hpa_metric() -> list[dict[str, Any]] | None:
        return (get("hpa") or {}).get("spec", {}).get("metrics")
    try:
        for metric, name in (("concurrency", "kubetrt_inflight_requests"), ("queue", "kubetrt_queue_depth")):
            say(f"spec.autoscaling: enabled, metric {metric}, targetAverageValue 3")
            _patch(canary_flow, {"autoscaling": {"enabled": True, "metric": metric, "targetAverageValue": 3,
                                                 "minReplicas": 1, "maxReplicas": 2}})
            want = [{"type": "Pods", "pods": {"metric": {"name": name},
                                              "target": {"type": "AverageValue", "averageValue": "3"}}}]
            got = wait_until(f"the HPA on {name}", lambda: hpa_metric() == want and hpa_metric(), timeout=60)
            say(f"HPA {hpa_name}: {json.dumps(got)}")
        hpa = kubectl_json("get", "hpa", hpa_name, "-n", NS)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": hpa_name}
        auto = canary_flow.get()["status"]["autoscaling"]
        say(f"status.autoscaling: {auto}")
        assert auto["mechanism"] == "HPA" and "KEDA's ScaledObject CRD is not served" in auto["message"], auto

        upstream_crds.install(upstream_crds.SCALED_OBJECT)

        def scaled() -> dict[str, Any] | None:
            _poke(canary_flow)  # the operator asks discovery again a minute after it last did
            return get("scaledobject") if get("hpa") is None else None
        so = wait_until("a KEDA ScaledObject in place of the HPA", scaled, timeout=150, period=5)
        say(f"ScaledObject {hpa_name}: {json.dumps(so['spec'])}")
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"] == PROMETHEUS_URL
        assert trigger["metadata"]["query"].startswith("sum(kubetrt_queue_depth{") and \
            trigger["metadata"]["threshold"] == "3"
        assert so["spec"]["scaleTargetRef"]["name"] == hpa_name and so["metadata"]["ownerReferences"][0]["name"] == NAME
        auto = wait_until("status.autoscaling KEDA", lambda: (canary_flow.get()["status"].get("autoscaling") or {})
                          .get("mechanism") == "KEDA" and canary_flow.get()["status"]["autoscaling"], timeout=30)
        say(f"status.autoscaling: {auto}")
        events = [e["message"] for e in _events(canary_flow, "Autoscaling")]
        assert any(m.startswith("KEDA: ") for m in events), events

        _patch(canary_flow, {"autoscaling": {"metric": "cpu"}})
        wait_until("the HPA back on CPU utilization (KEDA or not), the ScaledObject gone",
                   lambda: (hpa_metric() or [{}])[0].get("type") == "Resource" and get("scaledobject") is None,
                   timeout=60)
    finally:
        _patch(canary_flow, {"autoscaling": {"enabled": False}})
    wait_until("the HPA removed with autoscaling off", lambda: hpa_metric() is None, timeout=60)


# ----------------------------------------------------------------------------- disruption budgets, monitoring
def test_each_target_has_a_disruption_budget(canary_flow: Flow) -> None:
    pdb = kubectl_json("get", "poddisruptionbudget", f"{NAME}-{canary_flow.cpu_target}", "-n", NS)
    say(f"PodDisruptionBudget {pdb['metadata']['name']}: maxUnavailable {pdb['spec']['maxUnavailable']}, "
        f"status {pdb.get('status')}")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == {names.LABEL_MD: NAME, names.LABEL_TARGET: canary_flow.cpu_target,
                                                      names.LABEL_APP_COMPONENT: "serving"}

    def counted() -> dict[str, Any] | None:
        st = kubectl_json("get", "poddisruptionbudget", pdb["metadata"]["name"], "-n", NS).get("status") or {}
        return st if (st.get("expectedPods"), st.get("disruptionsAllowed")) == (1, 1) else None
    st = wait_until("the disruption controller counts the serving pod, one eviction allowed", counted, timeout=60)
    say(f"PodDisruptionBudget status: {json.dumps(st)}")


def test_a_service_monitor_once_the_prometheus_operators_crd_is_installed(canary_flow: Flow) -> None:
    assert kubectl("get", "servicemonitors", "-n", NS, check=False).returncode != 0, "no such CRD yet"
    say("the operator detects the ServiceMonitor CRD by API discovery")
    upstream_crds.install(upstream_crds.SERVICE_MONITOR)
    try:

        def monitor() -> dict[str, Any] | None:
            # any sync of the ModelDeployment notices the CRD once the discovery cache expires (a minute)
            _poke(canary_flow)
            found = kubectl("get", "servicemonitor", NAME, "-n", NS, "-o", "json", check=False)
            return json.loads(found.stdout) if found.returncode == 0 else None
        sm = wait_until("the ServiceMonitor of the ModelDeployment", monitor, timeout=150, period=5)
        say(f"ServiceMonitor {NAME}: {json.dumps(sm['spec'])}")
        assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics"}]
        assert sm["spec"]["selector"]["matchLabels"][names.LABEL_MD] == NAME
        assert sm["metadata"]["ownerReferences"][0]["name"] == NAME
        assert names.LABEL_REVISION in sm["spec"]["podTargetLabels"] and names.LABEL_MD in sm["spec"]["podTargetLabels"]
        excluded = {e["key"] for e in sm["spec"]["selector"]["matchExpressions"]}
        assert excluded == {names.LABEL_ROLE, names.LABEL_TRACK}, "the fallback and track Services are not scraped"
    finally:
        kubectl("delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=false", check=False)
