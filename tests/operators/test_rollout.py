"""Revisions and canary replica counts: the pure split, the revision bookkeeping, and the plans a
model change makes with and without spec.rollout.canaryTrafficPercent."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from kubetrt.operators import names, reconcile, rollout
from kubetrt.operators.reconcile import Observed

from operator_testlib import md_body
from test_operator_reconcile import converge, flag, verify


# ----------------------------------------------------------------------------- replica split
@pytest.mark.parametrize("total,pct,want", [
    (1, 10, (1, 1)),     # one replica at any share still runs one of each
    (4, 25, (3, 1)),
    (4, 30, (2, 2)),     # ceil(1.2) = 2
    (10, 10, (9, 1)),
    (10, 1, (9, 1)),     # at least one canary
    (3, 99, (1, 3)),     # the stable revision keeps one while pct < 100
    (5, 100, (0, 5)),
    (0, 50, (1, 1)),     # a target scaled to 0 is treated as 1
])
def test_split_rounds_the_canary_up_and_keeps_one_of_each(total: int, pct: int, want: tuple[int, int]) -> None:
    assert rollout.split_replicas(total, pct) == want


@pytest.mark.parametrize("pct", [0, -5, 101])
def test_split_rejects_a_share_out_of_range_naming_it(pct: int) -> None:
    with pytest.raises(ValueError, match=f"canaryTrafficPercent={pct}: expected 1..100"):
        rollout.split_replicas(4, pct)


@pytest.mark.parametrize("stable,pct,want", [(3, 25, 1), (4, 50, 4), (2, 10, 1), (9, 10, 1), (10, 10, 2)])
def test_canary_beside_an_autoscaled_stable_takes_its_share_of_all_pods(stable: int, pct: int, want: int) -> None:
    assert rollout.canary_beside(stable, pct) == want
    assert want / (stable + want) >= pct / 100


def test_canary_percent_reads_kserve_semantics() -> None:
    assert rollout.canary_percent({}) is None
    assert rollout.canary_percent({"rollout": {"maxSurge": "25%"}}) is None
    assert rollout.canary_percent({"rollout": {"canaryTrafficPercent": 100}}) is None  # promotion
    assert rollout.canary_percent({"rollout": {"canaryTrafficPercent": 20}}) == 20


# ----------------------------------------------------------------------------- revision ids
def test_revision_changes_with_version_digest_or_package_and_reads_the_version() -> None:
    base = {"name": "m", "version": "3", "packageURI": "s3://a/pkg"}
    rev = rollout.revision_of(base)
    assert rev.startswith("v3-") and rev == rollout.revision_of(dict(base))
    others = {rollout.revision_of({**base, "version": "4"}), rollout.revision_of({**base, "packageURI": "s3://b"}),
              rollout.revision_of({**base, "digest": "sha256:" + "a" * 64})}
    assert rev not in others and len(others) == 3
    assert rollout.revision_of({**base, "name": "renamed"}) == rev, "the model's name is not its revision"


def test_revision_of_any_version_is_a_label_value() -> None:
    import re
    rev = rollout.revision_of({"version": "2026.01 RC/1 " + "x" * 80, "packageURI": "s3://a"})
    assert re.match(names.LABEL_VALUE_PATTERN, rev) and len(rev) <= names.LABEL_VALUE_MAX


# ----------------------------------------------------------------------------- revision bookkeeping
def _build(version: str, key: str) -> dict[str, Any]:
    return {"spec": {"model": {"version": version, "packageURI": "s3://a"}}, "status": {"engineKey": key}}


def _pod(rev: str, ready: bool, key: str = "k", terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"p-{rev}", "labels": {names.LABEL_REVISION: rev},
                            "annotations": {names.ANN_ENGINE_KEY: key, names.ANN_MODEL_VERSION: "0"}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_revisions_count_ready_pods_and_their_traffic_share() -> None:
    v1, v2 = rollout.revision_of(_build("1", "")["spec"]["model"]), rollout.revision_of(_build("2", "")["spec"]["model"])
    pods = [_pod(v1, True), _pod(v1, True), _pod(v1, True), _pod(v2, True, "k2"), _pod(v2, False, "k2"),
            _pod(v1, True, terminating=True), _pod("v0-old", True, "k0")]
    revs = rollout.revisions([_build("1", "k1"), _build("1", "k1")], [_build("2", "k2")], pods)
    assert [(r["name"], r["role"], r["modelVersion"], r["readyReplicas"], r["trafficPercent"]) for r in revs] == [
        (v1, "stable", "1", 3, 60), (v2, "canary", "2", 1, 20), ("v0-old", "previous", "0", 1, 20)]
    assert revs[0]["engineKeys"] == ["k", "k1"] and revs[1]["engineKeys"] == ["k2"]


def test_revisions_without_pods_have_no_traffic() -> None:
    (rev,) = rollout.revisions([_build("1", "k1")], [], [])
    assert (rev["readyReplicas"], rev["trafficPercent"], rev["role"]) == (0, 0, "stable")


# ----------------------------------------------------------------------------- plans
def _cpu_md(**rollout_spec: Any) -> dict[str, Any]:
    md = md_body(targets=[{"name": "cpu", "cpu": True, "replicas": 4}])
    if rollout_spec:
        md["spec"]["rollout"] = rollout_spec
    return md


def _ready(obs: Observed, name: str) -> None:
    """What the Deployment controller reports once every replica of the template is ready."""
    dep = obs.deployments[name]
    n = dep["spec"].get("replicas", 1)
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "updatedReplicas": n, "readyReplicas": n, "replicas": n}


def _serving(md: dict[str, Any], world: Observed | None = None) -> tuple[Observed, str]:
    """``md`` serving version 3 on its stable Deployment (in ``world``: which CRDs it serves)."""
    _, obs = converge(md, world or Observed())
    verify(obs, "cpu", "key-v3")
    _, obs = converge(md, obs)
    _ready(obs, "resnet-cpu")
    return obs, rollout.deployment_revision(obs.deployments["resnet-cpu"]) or ""


def _new_version(md: dict[str, Any], version: str) -> dict[str, Any]:
    md = copy.deepcopy(md)
    md["spec"]["model"]["version"] = version
    md["metadata"]["generation"] += 1
    return md


def _canary_verified(md: dict[str, Any], hpa_replicas: int | None = None, world: Observed | None = None
                     ) -> tuple[dict[str, Any], Observed, reconcile.Plan, str]:
    """``md`` serving version 3, then version 4 asked for and its engine verified: (``md`` at version
    4, the world after the plan that follows the verification, that plan, version 3's revision).
    ``hpa_replicas``: the stable count an HPA set meanwhile."""
    obs, v3 = _serving(md, world)
    if hpa_replicas is not None:
        obs.deployments["resnet-cpu"]["spec"]["replicas"] = hpa_replicas
    md = _new_version(md, "4")
    _, obs = converge(md, obs)
    verify(obs, "cpu", "key-v4")
    plan, obs = converge(md, obs)
    return md, obs, plan, v3


def test_without_rollout_a_new_revision_rolls_the_stable_deployment_once_verified() -> None:
    md = _cpu_md()
    obs, v3 = _serving(md)
    md = _new_version(md, "4")
    plan, obs = converge(md, obs)
    assert not [o for o in plan.apply if o["kind"] == "Deployment"], "version 4 is not verified yet"
    verify(obs, "cpu", "key-v4")
    plan, obs = converge(md, obs)
    (dep,) = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert dep["metadata"]["name"] == "resnet-cpu" and flag(dep, "--model-version") == "4"
    assert dep["spec"]["replicas"] == 4 and dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    v4 = rollout.deployment_revision(dep)
    assert v4 != v3 and dep["spec"]["template"]["metadata"]["labels"][names.LABEL_TRACK] == names.TRACK_STABLE
    assert "resnet-cpu-canary" not in obs.deployments
    assert (plan.status["currentRevision"], plan.status["canaryRevision"]) == (v4, "-")


def test_canary_comes_up_beside_the_stable_revision_then_takes_its_share() -> None:
    md, obs, plan, v3 = _canary_verified(_cpu_md(canaryTrafficPercent=30))
    canary = obs.deployments["resnet-cpu-canary"]
    assert flag(canary, "--model-version") == "4" and canary["spec"]["replicas"] == 2  # ceil(4 * 0.3)
    assert canary["spec"]["selector"]["matchLabels"][names.LABEL_TRACK] == names.TRACK_CANARY
    assert canary["spec"]["template"]["metadata"]["labels"][names.LABEL_TRACK] == names.TRACK_CANARY
    stable = obs.deployments["resnet-cpu"]
    assert flag(stable, "--model-version") == "3" and stable["spec"]["replicas"] == 4, \
        "the stable revision keeps every replica until the canary's are ready"
    v4 = rollout.deployment_revision(canary)
    assert (plan.status["currentRevision"], plan.status["canaryRevision"]) == (v3, v4)
    assert [r["role"] for r in plan.status["revisions"]] == ["stable", "canary"]

    _ready(obs, "resnet-cpu-canary")
    plan, obs = converge(md, obs)
    assert obs.deployments["resnet-cpu"]["spec"]["replicas"] == 2 and flag(obs.deployments["resnet-cpu"],
                                                                           "--model-version") == "3"
    _ready(obs, "resnet-cpu")
    plan, obs = converge(md, obs)
    assert not plan.apply and not plan.delete, "a held canary is a fixed point"
    progressing = next(c for c in plan.status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "Canary" and v4 in progressing["message"]
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"


def test_promotion_rolls_the_stable_deployment_and_removes_the_canary_once_it_runs_the_revision() -> None:
    md, obs, _, _ = _canary_verified(_cpu_md(canaryTrafficPercent=30))
    _ready(obs, "resnet-cpu-canary")
    _, obs = converge(md, obs)
    v4 = rollout.deployment_revision(obs.deployments["resnet-cpu-canary"])

    md["spec"]["rollout"]["canaryTrafficPercent"] = 100
    plan, obs = converge(md, obs)
    stable = obs.deployments["resnet-cpu"]
    assert flag(stable, "--model-version") == "4" and stable["spec"]["replicas"] == 4
    assert "resnet-cpu-canary" in obs.deployments, "the canary serves until the stable Deployment rolled out"
    _ready(obs, "resnet-cpu")
    plan, obs = converge(md, obs)
    assert ("apps/v1", "Deployment", "resnet-cpu-canary") in plan.delete
    assert (plan.status["currentRevision"], plan.status["canaryRevision"]) == (v4, "-")
    assert len([eb for eb in obs.engine_builds.values()]) == 1, "version 3's build is gone with its revision"


def test_a_third_version_drops_the_canary_of_the_second() -> None:
    md, obs, _, v3 = _canary_verified(_cpu_md(canaryTrafficPercent=50))
    md = _new_version(md, "5")
    plan, obs = converge(md, obs)
    assert ("apps/v1", "Deployment", "resnet-cpu-canary") in plan.delete
    assert flag(obs.deployments["resnet-cpu"], "--model-version") == "3"
    assert plan.status["currentRevision"] == v3


def test_autoscaled_stable_keeps_the_hpa_count_and_the_canary_gets_its_share() -> None:
    md = _cpu_md(canaryTrafficPercent=25)
    md["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 8}
    md, obs, plan, _ = _canary_verified(md, hpa_replicas=6)
    assert obs.deployments["resnet-cpu-canary"]["spec"]["replicas"] == 2  # ceil(6 * 25 / 75)
    assert not [o for o in plan.apply if o["metadata"]["name"] == "resnet-cpu"], "the HPA owns the stable count"
    (hpa,) = obs.autoscalers.values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "resnet-cpu"


# ----------------------------------------------------------------------------- disruption budgets
def test_each_target_gets_a_disruption_budget_over_both_revisions_pods() -> None:
    md = _cpu_md(canaryTrafficPercent=30)
    obs, _ = _serving(md)
    (pdb,) = obs.disruption_budgets.values()
    assert pdb["metadata"]["name"] == "resnet-cpu" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == {names.LABEL_MD: "resnet", names.LABEL_TARGET: "cpu",
                                                      names.LABEL_APP_COMPONENT: "serving"}, "not the build pods"
    assert names.LABEL_TRACK not in pdb["spec"]["selector"]["matchLabels"], "canary pods are covered too"
    assert pdb["metadata"]["ownerReferences"][0]["name"] == "resnet"


def test_the_switch_off_removes_the_budgets() -> None:
    import dataclasses
    from kubetrt.operators import reconcile
    from operator_testlib import CONFIG
    md = _cpu_md()
    obs, _ = _serving(md)
    plan = reconcile.plan_model_deployment(md, obs, dataclasses.replace(CONFIG, pod_disruption_budgets=False),
                                           "2026-01-01T00:00:00Z")
    assert ("policy/v1", "PodDisruptionBudget", "resnet-cpu") in plan.delete
    assert not [o for o in plan.apply if o["kind"] == "PodDisruptionBudget"]
