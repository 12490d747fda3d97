"""Canary analysis: the serving pods' metrics text parsed, the verdict from it, and the plans that
promote or roll back a canary (the RolledBack condition and Warning Event naming the cause)."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from kubetrt.operators import analysis, names, reconcile, rollout
from kubetrt.operators.reconcile import Observed
from kubetrt.serving.metrics import ServingMetrics

from operator_testlib import CONFIG, md_body
from test_operator_reconcile import apply, fail, flag, verify
from test_rollout import _ready, _new_version

ANALYSIS = {"windowSeconds": 60, "minRequests": 10, "maxErrorRate": 0.05, "maxP99Milliseconds": 100}


def served(success: int, errors: int = 0, bad: int = 0, seconds: float = 0.002, model: str = "m") -> str:
    """The /metrics text of a serving process that answered so."""
    metrics = ServingMetrics()
    m = metrics.for_model(model)
    for outcome, n in (("success", success), ("error", errors), ("bad_request", bad)):
        for _ in range(n):
            m.outcome[outcome].inc()
            m.request_duration.observe(seconds)
    return metrics.render().decode()


# ----------------------------------------------------------------------------- parsing
def test_the_serving_metrics_text_parses_into_outcomes_and_latency() -> None:
    got = analysis.canary_metrics([served(90, errors=10, bad=5), served(100, seconds=0.02)])
    assert (got.requests, got.errors) == (200, 10), "bad requests are the client's, not the canary's"
    assert got.error_rate() == pytest.approx(0.05)
    assert got.p99_ms() == pytest.approx(25.0)  # the 0.025 s bucket holds the 99th percentile


def test_other_models_are_left_out_when_a_model_is_named() -> None:
    got = analysis.canary_metrics([served(10, model="a"), served(5, errors=5, model="b")], model="a")
    assert (got.requests, got.errors) == (10, 0)


def test_no_samples_means_no_p99() -> None:
    assert analysis.canary_metrics([served(0)]).p99_ms() is None


def test_text_that_is_not_prometheus_names_the_line() -> None:
    with pytest.raises(analysis.MetricsError, match="line 2: .*expected 'name{labels} value'"):
        analysis.parse_samples("# HELP x\n<html>oops</html>\n")
    with pytest.raises(analysis.MetricsError, match="'abc': expected a number"):
        analysis.parse_samples('kubetrt_inference_requests_total{outcome="success"} abc')


# ----------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize("text,elapsed,state,reason", [
    (served(100, errors=10), 5, "Fail", "ErrorRate"),            # over the bound: fails before the window ends
    (served(100, seconds=0.2), 5, "Fail", "Latency"),
    (served(3, errors=3), 5, "Wait", "Analyzing"),               # too few requests prove nothing yet
    (served(100), 30, "Wait", "Analyzing"),
    (served(5), 90, "Wait", "TooFewRequests"),
    (served(100, errors=2), 60, "Pass", "AnalysisPassed"),
])
def test_verdict(text: str, elapsed: float, state: str, reason: str) -> None:
    got = analysis.verdict(ANALYSIS, analysis.canary_metrics([text]), elapsed)
    assert (got.state, got.reason) == (state, reason), got.message


def test_a_failing_verdict_names_what_was_measured_against_which_bound() -> None:
    got = analysis.verdict(ANALYSIS, analysis.canary_metrics([served(50, errors=50)]), 1)
    assert got.message == "canary error rate 50.0% (50 error(s) in 100 request(s)) over maxErrorRate 5.0%"
    got = analysis.verdict(ANALYSIS, analysis.canary_metrics([served(100, seconds=0.3)]), 1)
    assert got.message == "canary p99 latency 500 ms (bucket bound, 100 requests) over maxP99Milliseconds 100"


# ----------------------------------------------------------------------------- plans
T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:30Z", "2026-01-01T00:01:10Z"


def _plan(md: dict[str, Any], obs: Observed, now: str) -> tuple[reconcile.Plan, Observed, dict[str, Any]]:
    plan = reconcile.plan_model_deployment(md, obs, CONFIG, now)
    md = {**md, "status": plan.status}
    return plan, apply(plan, obs), md


def _stable_md(**observed: Any) -> tuple[dict[str, Any], Observed]:
    """Version 3 serving on one ready replica, a canary at 50% with analysis configured for the next."""
    md = md_body(targets=[{"name": "cpu", "cpu": True, "replicas": 1}],
                 rollout={"canaryTrafficPercent": 50, "canaryAnalysis": dict(ANALYSIS)})
    _, obs, md = _plan(md, Observed(**observed), T0)
    verify(obs, "cpu", "key-v3")
    _, obs, md = _plan(md, obs, T0)
    _ready(obs, "resnet-cpu")
    _, obs, md = _plan(md, obs, T0)
    return md, obs


def _canary_md(**observed: Any) -> tuple[dict[str, Any], Observed, str]:
    """Version 3 stable, version 4's canary ready (one replica each), analysis configured."""
    md, obs = _stable_md(**observed)
    md = _new_version(md, "4")
    _, obs, md = _plan(md, obs, T0)
    verify(obs, "cpu", "key-v4")
    _, obs, md = _plan(md, obs, T0)
    _ready(obs, "resnet-cpu-canary")
    return md, obs, rollout.deployment_revision(obs.deployments["resnet-cpu-canary"]) or ""


def test_a_canary_within_bounds_for_its_window_is_promoted() -> None:
    md, obs, v4 = _canary_md()
    obs.canary_metrics = [served(40)]
    plan, obs, md = _plan(md, obs, T0)
    assert md["status"]["canary"]["verdict"] == "Wait" and md["status"]["canary"]["readySince"] == T0
    assert reconcile.rollout_unsettled(md["spec"], md["status"])
    obs.canary_metrics = [served(400)]
    plan, obs, md = _plan(md, obs, T1)
    assert md["status"]["canary"]["readySince"] == T0, "the window runs from the first all-ready plan"
    assert "after 30s of 60s" in md["status"]["message"]
    plan, obs, md = _plan(md, obs, T2)
    assert md["status"]["promotedRevision"] == v4 and md["status"]["canary"]["verdict"] == "Pass"
    assert flag(obs.deployments["resnet-cpu"], "--model-version") == "4", "the stable Deployment takes it"
    assert [e.reason for e in plan.events] == ["Promoted"]
    assert md["status"]["currentRevision"] == v4 and not reconcile.rollout_unsettled(md["spec"], md["status"])
    _ready(obs, "resnet-cpu")
    plan, obs, md = _plan(md, obs, T2)
    assert ("apps/v1", "Deployment", "resnet-cpu-canary") in plan.delete
    assert md["status"]["canary"]["verdict"] == "Pass", "the deciding analysis stays readable"


def test_a_canary_over_its_error_bound_is_rolled_back_naming_the_cause() -> None:
    md, obs, v4 = _canary_md()
    old = copy.deepcopy(md["status"])
    obs.canary_metrics = [served(10, errors=10)]
    plan, obs, md = _plan(md, obs, T1)
    st = md["status"]
    assert st["rolledBack"] == {"revision": v4, "reason": "ErrorRate", "message":
                                "canary error rate 50.0% (10 error(s) in 20 request(s)) over maxErrorRate 5.0%"}
    assert ("apps/v1", "Deployment", "resnet-cpu-canary") in plan.delete
    stable = obs.deployments["resnet-cpu"]
    assert flag(stable, "--model-version") == "3" and stable["spec"]["replicas"] == 1
    cond = next(c for c in st["conditions"] if c["type"] == "RolledBack")
    assert cond["status"] == "True" and cond["reason"] == "ErrorRate" and v4 in cond["message"]
    (event,) = [e for e in plan.events if e.reason == "RolledBack"]
    assert event.type == "Warning" and "ErrorRate" in event.message and "50.0%" in event.message
    assert st["canaryRevision"] == "-" and not reconcile.rollout_unsettled(md["spec"], st)
    assert old.get("rolledBack") is None
    rolled_back_line = f"revision {v4} rolled back (ErrorRate): canary error rate 50.0%"
    assert st["message"].startswith(rolled_back_line), "the MESSAGE column names the rollback"

    _ready(obs, "resnet-cpu")
    plan, obs, md = _plan(md, obs, T2)
    assert not plan.apply and not plan.delete and not plan.events, "a rolled-back revision stays rolled back"
    assert md["status"]["canary"]["verdict"] == "Fail" and md["status"]["canary"]["revision"] == v4
    assert md["status"]["message"].startswith(rolled_back_line), "also once the stable revision serves again"
    md = _new_version(md, "5")
    plan, obs, md = _plan(md, obs, T2)
    assert not [c for c in md["status"]["conditions"] if c["type"] == "RolledBack"], "a new revision clears it"


def test_a_new_revision_whose_golden_check_fails_is_rolled_back() -> None:
    md, obs = _stable_md()
    md = _new_version(md, "4")
    _, obs, md = _plan(md, obs, T0)
    fail(obs, "cpu", reason="VerificationFailed")
    plan, obs, md = _plan(md, obs, T1)
    assert md["status"]["rolledBack"]["reason"] == "GoldenCheckFailed"
    assert "VerificationFailed" in md["status"]["rolledBack"]["message"]
    rev = md["status"]["rolledBack"]["revision"]
    assert md["status"]["message"].startswith(f"revision {rev} rolled back (GoldenCheckFailed): target cpu: "), \
        "the failed build is the rollback's cause: MESSAGE names the rollback"
    assert next(c for c in md["status"]["conditions"] if c["type"] == "Degraded")["status"] == "True"
    assert any(e.type == "Warning" and e.reason == "RolledBack" for e in plan.events)
    assert flag(obs.deployments["resnet-cpu"], "--model-version") == "3"


def test_a_stuck_canary_pod_rolls_the_canary_back() -> None:
    md, obs, v4 = _canary_md()
    obs.pods = [{"metadata": {"name": "resnet-cpu-canary-x", "labels": {
        names.LABEL_TARGET: "cpu", names.LABEL_TRACK: names.TRACK_CANARY}},
        "status": {"phase": "Running", "containerStatuses": [{"name": "serving", "restartCount": 4, "state": {
            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}}}]}}]
    plan, obs, md = _plan(md, obs, T1)
    assert md["status"]["rolledBack"]["reason"] == "CrashLoopBackOff"
    assert "resnet-cpu-canary-x" in md["status"]["rolledBack"]["message"]


def test_unreadable_metrics_keep_the_canary_waiting_and_say_why() -> None:
    md, obs, _ = _canary_md()
    obs.metrics_error = "pod resnet-cpu-canary-x: ApiException: (503)"
    plan, obs, md = _plan(md, obs, T2)
    assert md["status"]["canary"]["verdict"] == "Wait"
    assert "metrics unavailable: pod resnet-cpu-canary-x" in md["status"]["message"]
