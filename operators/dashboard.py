"""The Grafana dashboard the chart ships (helm/kubetrt/files/grafana-dashboard.json), built here so its
PromQL names the serving metrics (serving/metrics.py) and the labels the operator's ServiceMonitor
puts on them (objects.POD_TARGET_LABELS) from one place.

Every series comes from a serving pod, labelled ``model`` by the server; the ServiceMonitor adds the
target's ``namespace`` and the pods' revision (``kubetrt_io_revision``), so each panel is per model
and revision. ``python -m kubetrt.operators.install --write`` writes the file.
"""
from __future__ import annotations

import json
from typing import Any

from kubetrt.operators import analysis
from kubetrt.operators.names import LABEL_REVISION, prometheus_label

REVISION = prometheus_label(LABEL_REVISION)
BY = f"namespace, model, {REVISION}"  # the series every panel draws: one per model and revision
SELECTOR = f'namespace=~"$namespace", model=~"$model", {REVISION}=~"$revision"'
RATE = "$__rate_interval"  # Grafana's rate window (at least four scrape intervals)
LEGEND = "{{model}} {{" + REVISION + "}}"
ERRORS = "|".join(sorted(analysis.ERROR_OUTCOMES))  # the server's fault, as the canary analysis counts them
UID = "kubetrt-serving"


def _rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{{{SELECTOR}{extra}}}[{RATE}])"


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {BY}) ({_rate(histogram + '_bucket')}))"


def queries() -> dict[str, list[tuple[str, str]]]:
    """Panel title -> [(PromQL, legend)]."""
    success = _rate("kubetrt_inference_requests_total", ', outcome="success"')
    errors = _rate("kubetrt_inference_requests_total", f', outcome=~"{ERRORS}"')
    return {
        "Request latency p50 / p99": [
            (_quantile(0.5, "kubetrt_request_duration_seconds"), "p50 " + LEGEND),
            (_quantile(0.99, "kubetrt_request_duration_seconds"), "p99 " + LEGEND),
        ],
        "Throughput (successful requests/s)": [
            (f"sum by ({BY}) ({success})", LEGEND),
        ],
        "Errors (requests/s by outcome)": [
            (f"sum by ({BY}, outcome) ({errors})", LEGEND + " {{outcome}}"),
        ],
        "Batch size (rows per runtime call)": [
            (f"sum by ({BY}) ({_rate('kubetrt_batch_size_sum')}) / sum by ({BY}) ({_rate('kubetrt_batch_size_count')})",
             "mean " + LEGEND),
            (_quantile(0.99, "kubetrt_batch_size"), "p99 " + LEGEND),
        ],
        "Queue depth and in-flight requests": [
            (f"sum by ({BY}) (kubetrt_queue_depth{{{SELECTOR}}})", "queued " + LEGEND),
            (f"sum by ({BY}) (kubetrt_inflight_requests{{{SELECTOR}}})", "in flight " + LEGEND),
        ],
        "Queue wait p99": [(_quantile(0.99, "kubetrt_queue_duration_seconds"), "p99 " + LEGEND)],
    }


UNITS = {"Request latency p50 / p99": "s", "Throughput (successful requests/s)": "reqps",
         "Errors (requests/s by outcome)": "reqps", "Batch size (rows per runtime call)": "short",
         "Queue depth and in-flight requests": "short", "Queue wait p99": "s"}

# Template variables: Grafana's label_values(SELECTOR, LABEL) lists the values of LABEL on SELECTOR's series.
VARIABLES = [
    ("namespace", "label_values(kubetrt_inference_requests_total, namespace)"),
    ("model", 'label_values(kubetrt_inference_requests_total{namespace=~"$namespace"}, model)'),
    ("revision", f'label_values(kubetrt_inference_requests_total{{namespace=~"$namespace", model=~"$model"}}, '
                 f'{REVISION})'),
]


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard model (schemaVersion 39): one time series panel per query group."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    templating: list[dict[str, Any]] = [{"name": "datasource", "label": "Data source", "type": "datasource",
                                         "query": "prometheus", "current": {}, "hide": 0}]
    for name, query in VARIABLES:
        templating.append({"name": name, "label": name, "type": "query", "datasource": source,
                           "definition": query, "query": {"query": query, "refId": name},
                           "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                           "current": {}, "sort": 1, "hide": 0})
    panels = []
    for i, (title, exprs) in enumerate(queries().items()):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": source,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": UNITS[title]}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": source, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(exprs)],
        })
    return {"uid": UID, "title": "kubetrt serving", "tags": ["kubetrt"], "editable": True, "schemaVersion": 39,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "browser",
            "templating": {"list": templating}, "panels": panels, "annotations": {"list": []}}


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=False) + "\n"
