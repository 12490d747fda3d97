"""spec.autoscaling.metric: CPU utilization (the default), or in-flight / queued requests per pod as
an HPA Pods metric named as the serving pods' gauges."""
from __future__ import annotations

import pytest

from kubetrt.operators import objects
from kubetrt.serving.metrics import ServingMetrics

from operator_testlib import md_body


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
