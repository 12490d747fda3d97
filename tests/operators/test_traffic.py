"""Gateway API weighted backends: where the HTTPRoute CRD is served, an HTTPRoute per ModelDeployment
sends HTTP to the per-track Services <md>-stable and <md>-canary with weights 100-p and p (the
canary's once its pods are ready), attached to spec.rollout.gateway; the model's Service keeps the
replica-count split. status.traffic says which carries the share."""
from __future__ import annotations

from typing import Any

import pytest

from kubetrt.operators import names, objects, reconcile, rollout, sync
from kubetrt.operators.reconcile import Observed

from test_operator_reconcile import converge
from test_rollout import _canary_verified, _cpu_md, _ready

GATEWAY = {"name": "public", "namespace": "infra", "sectionName": "https"}


def _routes(obs: Observed) -> dict[str, Any]:
    assert obs.http_routes is not None
    (route,) = obs.http_routes.values()
    return route


def _weights(route: dict[str, Any]) -> dict[str, int]:
    (rule,) = route["spec"]["rules"]
    return {b["name"]: b["weight"] for b in rule["backendRefs"]}


def _routed(pct: int, **extra: Any) -> dict[str, Any]:
    return _cpu_md(canaryTrafficPercent=pct, gateway=dict(GATEWAY), **extra)


def _with_crd(md: dict[str, Any]) -> tuple[dict[str, Any], Observed, reconcile.Plan, str]:
    """_canary_verified on a cluster that serves the HTTPRoute CRD."""
    return _canary_verified(md, world=Observed(http_routes={}))


def test_no_route_and_no_track_services_without_the_crd() -> None:
    md, obs, plan, _ = _canary_verified(_routed(30))
    assert obs.http_routes is None and sorted(obs.services) == ["resnet"]
    assert plan.status["traffic"]["mechanism"] == rollout.TRAFFIC_REPLICAS
    assert "the Gateway API's HTTPRoute CRD is not served" in plan.status["traffic"]["message"]


def test_the_route_carries_the_exact_share_once_the_canary_is_ready_then_goes_back_on_promotion() -> None:
    md, obs, plan, _ = _with_crd(_routed(30))
    route = _routes(obs)
    assert _weights(route) == {"resnet-stable": 100}, "no share for a canary with no ready pod"
    _ready(obs, "resnet-cpu-canary")
    plan, obs = converge(md, obs)
    _ready(obs, "resnet-cpu")
    plan, obs = converge(md, obs)
    route = _routes(obs)
    assert _weights(route) == {"resnet-stable": 70, "resnet-canary": 30}, "exact, not the pods' 2 of 4"
    assert (obs.deployments["resnet-cpu"]["spec"]["replicas"], obs.deployments["resnet-cpu-canary"]["spec"]["replicas"]
            ) == (2, 2), "the model's Service keeps the replica split"
    assert all(b["port"] == names.SERVING_PORT for b in route["spec"]["rules"][0]["backendRefs"])
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "public", "namespace": "infra", "sectionName": "https"}]
    assert route["metadata"]["ownerReferences"][0]["name"] == "resnet"
    traffic = plan.status["traffic"]
    assert (traffic["mechanism"], traffic["stableWeight"], traffic["canaryWeight"]) == ("HTTPRoute", 70, 30)
    assert "on Gateway infra/public listener https: weights resnet-stable 70, resnet-canary 30" in traffic["message"]
    assert not plan.apply and not plan.delete, "a held canary is a fixed point, route included"

    md["spec"]["rollout"]["canaryTrafficPercent"] = 100
    plan, obs = converge(md, obs)
    assert _weights(_routes(obs)) == {"resnet-stable": 100}, "promoted: the stable track takes it all"


def test_a_rolled_back_canary_leaves_only_the_stable_backend() -> None:
    md, obs, _, _ = _with_crd(_routed(50))
    _ready(obs, "resnet-cpu-canary")
    plan, obs = converge(md, obs)
    assert _weights(_routes(obs)) == {"resnet-stable": 50, "resnet-canary": 50}
    md = {**md, "status": {**plan.status, "rolledBack": {"revision": rollout.spec_revision(md["spec"]),
                                                           "reason": "ErrorRate", "message": "x"}}}
    md["spec"]["rollout"]["canaryAnalysis"] = {"windowSeconds": 60}
    plan, obs = converge(md, obs)
    assert ("apps/v1", "Deployment", "resnet-cpu-canary") in plan.delete
    assert _weights(_routes(obs)) == {"resnet-stable": 100}


def test_each_track_service_selects_its_tracks_pods_and_is_not_scraped_twice() -> None:
    md, obs, _, _ = _with_crd(_routed(30))
    stable, canary, main = obs.services["resnet-stable"], obs.services["resnet-canary"], obs.services["resnet"]
    assert stable["spec"]["selector"] == {**main["spec"]["selector"], names.LABEL_TRACK: names.TRACK_STABLE}
    assert canary["spec"]["selector"] == {**main["spec"]["selector"], names.LABEL_TRACK: names.TRACK_CANARY}
    assert [p["name"] for p in stable["spec"]["ports"]] == ["http", "grpc"]
    assert stable["metadata"]["ownerReferences"][0]["name"] == "resnet"
    pods = {t: obs.deployments[d]["spec"]["template"]["metadata"]["labels"]
            for t, d in (("stable", "resnet-cpu"), ("canary", "resnet-cpu-canary"))}
    for track, svc in (("stable", stable), ("canary", canary)):
        assert {t for t, labels in pods.items() if all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
                } == {track}
    monitor = objects.service_monitor(md)
    excluded = {e["key"] for e in monitor["spec"]["selector"]["matchExpressions"] if e["operator"] == "DoesNotExist"}
    assert names.LABEL_TRACK in stable["metadata"]["labels"] and names.LABEL_TRACK in excluded
    assert names.LABEL_TRACK not in main["metadata"]["labels"]


def test_without_a_gateway_the_route_is_attached_to_nothing_and_status_says_so() -> None:
    md, obs, plan, _ = _with_crd(_cpu_md(canaryTrafficPercent=30))
    route = _routes(obs)
    assert "parentRefs" not in route["spec"]
    traffic = plan.status["traffic"]
    assert traffic["mechanism"] == rollout.TRAFFIC_REPLICAS
    assert "attached to no Gateway: spec.rollout.gateway is unset" in traffic["message"]


def test_hostnames_and_a_gateway_in_the_models_namespace() -> None:
    md = _cpu_md(canaryTrafficPercent=10, gateway={"name": "gw", "hostnames": ["resnet.example.com"]})
    spec = objects.normalized_spec(md)
    route = objects.http_route(md, spec, 10)
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}]
    assert route["spec"]["hostnames"] == ["resnet.example.com"]


def test_the_crd_going_away_removes_the_track_services() -> None:
    md, obs, _, _ = _with_crd(_routed(30))
    obs.http_routes = None
    plan, obs = converge(md, obs)
    assert ("v1", "Service", "resnet-stable") in plan.delete and ("v1", "Service", "resnet-canary") in plan.delete


@pytest.mark.parametrize("pct,ready,want", [(None, [], 0), (30, [], 0), (30, [True, False], 0), (30, [True, True], 30)])
def test_route_weight(pct: int | None, ready: list[bool], want: int) -> None:
    assert rollout.route_weight(pct, ready) == want


def test_a_weight_out_of_range_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="canary weight 100: expected 0..99"):
        objects.http_route(_routed(30), objects.normalized_spec(_routed(30)), 100)


class _Discovery:
    def __init__(self, served: set[str]) -> None:
        self.served, self.asked = served, []

    def serves(self, api_version: str, plural: str) -> bool:
        self.asked.append((api_version, plural))
        return plural in self.served


def test_each_crd_is_discovered_on_its_own() -> None:
    sync._discovered.clear()
    kube = _Discovery({"httproutes"})
    assert sync.crd_served(kube, names.HTTP_ROUTE_API)  # type: ignore[arg-type]
    assert not sync.crd_served(kube, names.SCALED_OBJECT_API)  # type: ignore[arg-type]
    assert sync.crd_served(kube, names.HTTP_ROUTE_API)  # type: ignore[arg-type]
    assert kube.asked == [("gateway.networking.k8s.io/v1", "httproutes"), ("keda.sh/v1alpha1", "scaledobjects")]
    sync._discovered.clear()
