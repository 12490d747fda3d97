"""The ServiceMonitor per ModelDeployment: planned only where the Prometheus Operator's CRD is served,
scraping the model's Service (every revision's pods, never the <name>-fallback Service as well)."""
from __future__ import annotations

from typing import Any

from kubetrt.operators import names, reconcile, sync
from kubetrt.operators.reconcile import Observed

from operator_testlib import CONFIG, md_body

NOW = "2026-01-01T00:00:00Z"


def _md() -> dict[str, Any]:
    return md_body(targets=[{"name": "h100", "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
                            {"name": "cpu", "cpu": True, "fallback": True}])


def test_no_service_monitor_without_the_crd() -> None:
    plan = reconcile.plan_model_deployment(_md(), Observed(service_monitors=None), CONFIG, NOW)
    assert not [o for o in plan.apply if o["kind"] == "ServiceMonitor"]


def test_one_service_monitor_for_the_models_service_where_the_crd_is_served() -> None:
    plan = reconcile.plan_model_deployment(_md(), Observed(service_monitors={}), CONFIG, NOW)
    (monitor,) = [o for o in plan.apply if o["kind"] == "ServiceMonitor"]
    services = {o["metadata"]["name"]: o for o in plan.apply if o["kind"] == "Service"}
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["name"] == "resnet"
    sel = monitor["spec"]["selector"]

    def selects(svc: dict[str, Any]) -> bool:
        have = svc["metadata"]["labels"]
        return all(have.get(k) == v for k, v in sel["matchLabels"].items()) and all(
            e["key"] not in have for e in sel["matchExpressions"] if e["operator"] == "DoesNotExist")
    assert selects(services["resnet"]) and not selects(services["resnet-fallback"])
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics"}]
    assert names.LABEL_REVISION in monitor["spec"]["podTargetLabels"], "series say which revision served"


def test_a_stale_monitor_is_deleted() -> None:
    plan = reconcile.plan_model_deployment(_md(), Observed(service_monitors={"old": {}}), CONFIG, NOW)
    assert ("monitoring.coreos.com/v1", "ServiceMonitor", "old") in plan.delete


class _Discovery:
    def __init__(self, served: bool) -> None:
        self.served, self.calls = served, 0

    def serves(self, api_version: str, plural: str) -> bool:
        self.calls += 1
        assert (api_version, plural) == ("monitoring.coreos.com/v1", "servicemonitors")
        return self.served


def test_discovery_is_cached_then_asked_again(monkeypatch: Any) -> None:
    sync._discovered.clear()
    kube = _Discovery(True)
    assert sync.crd_served(kube, names.SERVICE_MONITOR_API) and sync.crd_served(kube, names.SERVICE_MONITOR_API)  # type: ignore[arg-type]
    assert kube.calls == 1
    monkeypatch.setattr(sync, "DISCOVERY_TTL_SECONDS", -1.0)
    kube.served = False
    assert not sync.crd_served(kube, names.SERVICE_MONITOR_API)  # type: ignore[arg-type]
    sync._discovered.clear()
