"""The chart's Grafana dashboard, for effect: rendered by the real helm, every PromQL expression (and
template variable query) parsed by Prometheus' own parser (tests/operators/promql, a Go program on
github.com/prometheus/prometheus/promql/parser), and every metric and label name it uses found on
the series a real serving process exposes at /metrics, plus the labels the operator's ServiceMonitor
puts on them."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from helm_binary import helm, run  # noqa: F401  helm is a fixture
from kubetrt.operators import analysis, names, objects

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "serving"))

from serving_support import LiveServer, cnn_input  # noqa: E402

PROMQL_SOURCE = HERE / "promql"
# Labels the Prometheus Operator gives every target a ServiceMonitor scrapes (its endpoints role),
# besides the pod labels named in podTargetLabels.
SERVICE_MONITOR_TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")


@pytest.fixture(scope="module")
def promql(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parser, built from its pinned module (go.mod, go.sum) through the Go module proxy."""
    go = shutil.which("go")
    if go is None:
        pytest.fail("Go is needed to build the PromQL parser (tests/operators/promql): go.dev/doc/install")
    out = tmp_path_factory.mktemp("promql") / "promql"
    res = subprocess.run([go, "build", "-o", str(out), "."], cwd=PROMQL_SOURCE, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    return out


def parse(promql: Path, exprs: list[str]) -> list[dict[str, Any]]:
    res = subprocess.run([str(promql)], input=json.dumps(exprs), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return list(json.loads(res.stdout))


@pytest.fixture(scope="module")
def scraped(model_zoo: Any) -> str:
    """/metrics of the serving app (as `kubetrt serve` runs it) after it answered a request."""
    from kubetrt.serving.app import create_app
    from kubetrt.serving.registry import ServingConfig

    with LiveServer(create_app([model_zoo.package("small_cnn")], ServingConfig(device="host"))) as live:
        live.wait_ready()
        with httpx.Client(base_url=live.url, timeout=30) as c:
            x = cnn_input()
            body = {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32",
                                "data": x.ravel().tolist()}]}
            name = c.get("/v2/models/small_cnn").json()["inputs"][0]["name"]
            body["inputs"][0]["name"] = name
            assert c.post("/v2/models/small_cnn/infer", json=body).status_code == 200
            return c.get("/metrics").text


@pytest.fixture(scope="module")
def series(scraped: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) Prometheus stores for a serving pod scraped by the operator's
    ServiceMonitor."""
    samples = analysis.parse_samples(scraped)
    md = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "apiVersion": names.API_VERSION,
          "kind": names.KIND_MODEL_DEPLOYMENT}
    added = {names.prometheus_label(k) for k in objects.service_monitor(md)["spec"]["podTargetLabels"]}
    return {n for n, _, _ in samples}, {k for _, labels, _ in samples for k in labels} | added | \
        SERVICE_MONITOR_TARGET_LABELS


@pytest.fixture(scope="module")
def dashboard(helm: str) -> dict[str, Any]:
    res = run(helm, "template", "kubetrt", str(REPO / "helm" / "kubetrt"), "-n", "kubetrt-system",
              "--set", "grafanaDashboard.enabled=true", "--set", "grafanaDashboard.namespace=monitoring")
    assert res.returncode == 0, res.stderr
    (cm,) = [d for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", "the Grafana sidecar's label"
    assert cm["metadata"]["namespace"] == "monitoring"
    (text,) = cm["data"].values()
    return dict(json.loads(text))


def expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(PromQL, legend) of every panel target, and of every label_values variable's selector
    (with the label it lists as its legend)."""
    out = [(t["expr"], t.get("legendFormat", "")) for p in board["panels"] for t in p["targets"]]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            m = LABEL_VALUES.match(var["query"]["query"])
            assert m, var["query"]
            out.append((m["selector"], "{{" + m["label"] + "}}"))
    return out


def problems(promql: Path, exprs: list[tuple[str, str]], metric_names: set[str], label_names: set[str]) -> list[str]:
    """What in ``exprs`` no scraped series has; Grafana's $__rate_interval stands for a duration."""
    found = []
    parsed = parse(promql, [e.replace("$__rate_interval", "5m") for e, _ in exprs])
    for (expr, legend), got in zip(exprs, parsed):
        if got.get("error"):
            found.append(f"{expr}: {got['error']}")
            continue
        for sel in got["selectors"]:
            if sel["metric"] not in metric_names:
                found.append(f"{expr}: no series is named {sel['metric']}")
            found += [f"{expr}: no series has the label {k}" for k in sel["labels"] if k not in label_names]
        found += [f"{expr}: grouped by {k}, which no series has" for k in got["grouping"] if k not in label_names]
        grouped = set(got["grouping"]) - {"le"} if got["grouping"] else label_names
        found += [f"{expr}: the legend names {k}, which the result does not keep"
                  for k in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend) if k not in grouped]
    return found


def test_every_expression_parses_and_names_only_what_the_serving_pods_series_have(
        promql: Path, dashboard: dict[str, Any], series: tuple[set[str], set[str]]) -> None:
    exprs = expressions(dashboard)
    assert len(exprs) >= 10
    assert problems(promql, exprs, *series) == []


def test_the_panels_cover_latency_throughput_batch_size_queue_and_errors_per_model_and_revision(
        dashboard: dict[str, Any]) -> None:
    text = json.dumps([t["expr"] for p in dashboard["panels"] for t in p["targets"]])
    for metric in ("kubetrt_request_duration_seconds_bucket", "kubetrt_inference_requests_total",
                   "kubetrt_batch_size_sum", "kubetrt_queue_depth"):
        assert metric in text, metric
    assert "histogram_quantile(0.5," in text and "histogram_quantile(0.99," in text
    revision = names.prometheus_label(names.LABEL_REVISION)
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert f"model, {revision}" in target["expr"] and revision in target["legendFormat"], target


def test_the_check_catches_what_no_series_has(promql: Path, series: tuple[set[str], set[str]]) -> None:
    """The check above can fail: a label the pods do not carry (revision, as the server does not
    name it), a metric the server does not export, a legend label the aggregation drops, bad PromQL."""
    bad = [('sum by (model, revision) (kubetrt_queue_depth)', ""),
           ('sum(rate(kubetrt_requests_total[$__rate_interval]))', ""),
           ('sum by (model) (kubetrt_queue_depth)', "{{pod}}"),
           ('sum by (model (kubetrt_queue_depth)', "")]
    found = problems(promql, bad, *series)
    assert len(found) == 4, found
    assert "grouped by revision, which no series has" in found[0] and "named kubetrt_requests_total" in found[1]
    assert "legend names pod" in found[2] and "parse error" in found[3]


def test_the_dashboard_is_off_by_default(helm: str) -> None:
    res = run(helm, "template", "kubetrt", str(REPO / "helm" / "kubetrt"), "-n", "kubetrt-system")
    assert res.returncode == 0, res.stderr
    assert not [d for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "ConfigMap"]


@pytest.mark.parametrize("metric", ["concurrency", "queue"])
def test_kedas_query_selects_only_what_the_scraped_series_carry(promql: Path, series: tuple[set[str], set[str]],
                                                                metric: str) -> None:
    md = {"metadata": {"name": "m", "namespace": "ns"}}
    assert problems(promql, [(objects.keda_query(md, {"name": "cpu"}, metric), "")], *series) == []
