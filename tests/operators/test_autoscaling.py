"""spec.autoscaling.metric: CPU utilization (the default), or in-flight / queued requests per pod as
an HPA Pods metric named as the serving pods' gauges, or, where KEDA's CRD is served and the operator
knows its Prometheus, a KEDA ScaledObject querying them."""
from __future__ import annotations

import dataclasses

import pytest

from kubetrt.operators import objects, reconcile
from kubetrt.operators.reconcile import Observed
from kubetrt.serving.metrics import ServingMetrics

from operator_testlib import CONFIG, md_body
from test_rollout import _serving

NOW = "2026-01-01T00:00:00Z"


def _hpa(**auto: object) -> dict:
    md = md_body(autoscaling={"enabled": True, "maxReplicas": 6, **auto})
    spec = objects.normalized_spec(md)
    return objects.autoscaler(md, spec, objects.resolve_target(spec, spec["targets"][0]))


def test_cpu_is_the_default() -> None:
    (metric,) = _hpa()["spec"]["metrics"]
    assert metric == {"type": "Resource", "resource": {"name": "cpu", "target": {
        "type": "Utilization", "averageUtilization": 80}}}


@pytest.mark.parametrize("metric,name", [("concurrency", "kubetrt_inflight_requests"),
                                         ("queue", "kubetrt_queue_depth")])
def test_load_metrics_are_pods_metrics_named_as_the_serving_gauges(metric: str, name: str) -> None:
    (got,) = _hpa(metric=metric, targetAverageValue=6)["spec"]["metrics"]
    assert got == {"type": "Pods", "pods": {"metric": {"name": name},
                                            "target": {"type": "AverageValue", "averageValue": "6"}}}
    assert f"# TYPE {name} gauge" in ServingMetrics().render().decode(), "the serving pods export it"


def test_default_target_average_value() -> None:
    (got,) = _hpa(metric="concurrency")["spec"]["metrics"]
    assert got["pods"]["target"]["averageValue"] == "4"


def test_an_unknown_metric_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match="spec.autoscaling.metric='gpu': expected one of cpu, concurrency, queue"):
        objects.autoscaling_metric({"metric": "gpu"})


# ----------------------------------------------------------------------------- KEDA or HPA
URL = "http://prometheus-operated.monitoring.svc:9090"


@pytest.mark.parametrize("metric,keda,url,want,why", [
    ("cpu", True, URL, "HPA", "metric cpu"),
    ("concurrency", True, URL, "KEDA", "KEDA's ScaledObject CRD is served and KUBETRT_PROMETHEUS_URL is set"),
    ("queue", True, "", "HPA", "KEDA's ScaledObject CRD is served but KUBETRT_PROMETHEUS_URL is not set"),
    ("concurrency", False, URL, "HPA", "KEDA's ScaledObject CRD is not served: an HPA on the Pods metric "
                                       "kubetrt_inflight_requests from the custom metrics API"),
])
def test_keda_where_its_crd_is_served_and_prometheus_is_known(metric: str, keda: bool, url: str, want: str,
                                                              why: str) -> None:
    got = objects.autoscaling_choice({"metric": metric}, keda, url)
    assert got.mechanism == want and why in got.reason, got


def _keda_md(metric: str = "concurrency") -> dict:
    return md_body(targets=[{"name": "cpu", "cpu": True}],
                   autoscaling={"enabled": True, "metric": metric, "targetAverageValue": 5, "maxReplicas": 6})


def test_the_scaled_object_scales_the_stable_deployment_on_the_targets_summed_gauge() -> None:
    config = dataclasses.replace(CONFIG, prometheus_url=URL)
    obs, _ = _serving(_keda_md(), Observed(scaled_objects={}, autoscalers={"resnet-cpu": {"metadata": {}}}))
    plan = reconcile.plan_model_deployment(_keda_md(), obs, config, NOW)
    (so,) = [o for o in plan.apply if o["kind"] == "ScaledObject"]
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["ownerReferences"][0]["name"] == "resnet"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "resnet-cpu"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 6)
    (trigger,) = so["spec"]["triggers"]
    assert trigger == {"type": "prometheus", "metadata": {
        "serverAddress": URL, "threshold": "5",
        "query": 'sum(kubetrt_inflight_requests{namespace="models",kubetrt_io_model_deployment="resnet",'
                 'kubetrt_io_target="cpu",kubetrt_io_track="stable"})'}}
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "resnet-cpu") in plan.delete, "KEDA's HPA replaces it"
    assert not [o for o in plan.apply if o["kind"] == "HorizontalPodAutoscaler"]
    assert plan.status["autoscaling"]["mechanism"] == "KEDA"
    (event,) = [e for e in plan.events if e.reason == "Autoscaling"]
    assert event.type == "Normal" and event.message.startswith("KEDA: KEDA's ScaledObject CRD is served")


def test_without_a_prometheus_address_the_hpa_stays_and_a_scaled_object_goes() -> None:
    plan = reconcile.plan_model_deployment(_keda_md("queue"), Observed(scaled_objects={"resnet-cpu": {}}), CONFIG, NOW)
    assert ("keda.sh/v1alpha1", "ScaledObject", "resnet-cpu") in plan.delete
    obs, _ = _serving(_keda_md("queue"), Observed(scaled_objects={}))
    plan = reconcile.plan_model_deployment(_keda_md("queue"), obs, CONFIG, NOW)
    assert plan.status["autoscaling"] == {"mechanism": "HPA", "message": objects.autoscaling_choice(
        {"metric": "queue"}, True, "").reason}
    assert obs.autoscalers["resnet-cpu"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kubetrt_queue_depth"


def test_no_autoscaling_status_while_autoscaling_is_off() -> None:
    plan = reconcile.plan_model_deployment(md_body(), Observed(scaled_objects={}), CONFIG, NOW)
    assert plan.status["autoscaling"] is None and not [e for e in plan.events if e.reason == "Autoscaling"]


def test_a_scaled_object_needs_the_prometheus_address() -> None:
    md = _keda_md()
    spec = objects.normalized_spec(md)
    with pytest.raises(ValueError, match="needs the Prometheus address \\(KUBETRT_PROMETHEUS_URL\\)"):
        objects.scaled_object(md, spec, objects.resolve_target(spec, spec["targets"][0]), "")


def test_kedas_own_hpa_is_not_the_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """KEDA's keda-hpa-<name> copies the ScaledObject's labels, so the operator's label selector finds
    it: observe keeps only the HPAs the ModelDeployment controls, so none is deleted as stale."""
    from kubetrt.operators import sync
    ours = {"metadata": {"name": "resnet-cpu", "ownerReferences": [{"kind": "ModelDeployment", "controller": True}]}}
    kedas = {"metadata": {"name": "keda-hpa-resnet-cpu", "ownerReferences": [{"kind": "ScaledObject",
                                                                              "controller": True}]}}

    class Kube:
        def list(self, api_version: str, kind: str, namespace: str, sel: dict) -> list:
            return [ours, kedas] if kind == "HorizontalPodAutoscaler" else []

        def serves(self, api_version: str, plural: str) -> bool:
            return False
    sync._discovered.clear()
    assert list(sync.observe(Kube(), "models", "resnet").autoscalers) == ["resnet-cpu"]  # type: ignore[arg-type]
    sync._discovered.clear()
