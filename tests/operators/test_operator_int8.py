"""INT8 in the API: calibration in the ModelDeployment schema, the operator's own check of the CEL
rule, and the calibration URI carried into EngineBuilds and their build Jobs (pure and on kmock)."""
from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kubetrt.cli import build_parser
from kubetrt.operators import crds, names, objects, reconcile
from kubetrt.operators.kube import KubeClient
from kubetrt.operators.reconcile import Observed

from operator_testlib import CALIBRATION_URI, CONFIG, ApiServerEmulator, eventually, md_body
from test_operator_integration import client, condition, objs  # noqa: F401  (client is a fixture)

REPO = Path(__file__).resolve().parents[2]
NOW = "2026-01-01T00:00:00Z"


def generated_crd(name: str) -> dict[str, Any]:
    """The CRD as installed: the chart's generated YAML, not the Python dict it came from."""
    return yaml.safe_load((REPO / "helm" / "kubetrt" / "crds" / f"{name}.kubetrt.io.yaml").read_text())


def md_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(crds.object_schema(generated_crd("modeldeployments")))


def without_calibration(md: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(md)
    del out["spec"]["optimization"]["calibration"]
    return out


def errors(md: dict[str, Any]) -> list[str]:
    return objects.validate_spec(objects.normalized_spec(md))


# ----------------------------------------------------------------------------- schema
CALIBRATIONS_ACCEPTED = {
    "uri only": {"uri": CALIBRATION_URI},
    "percentile": {"uri": "pvc://datasets/resnet50/calib", "method": "percentile", "percentile": 99.99,
                   "holdoutFraction": 0.1},
    "minmax from a node path": {"uri": "file:///srv/calibration.npz", "method": "minmax"},
}


@pytest.mark.parametrize("name", sorted(CALIBRATIONS_ACCEPTED))
def test_int8_with_calibration_is_accepted(name: str) -> None:
    md = md_body(optimization={"calibration": CALIBRATIONS_ACCEPTED[name]})
    md_validator().validate(md)
    assert errors(md) == []


CALIBRATIONS_REJECTED = {
    "no uri": {"method": "entropy"},
    "uri without a scheme": {"uri": "/data/calibration.npz"},
    "http uri": {"uri": "http://example.com/calibration.npz"},
    "unknown method": {"uri": CALIBRATION_URI, "method": "kl"},
    "holdout above 1": {"uri": CALIBRATION_URI, "holdoutFraction": 1.5},
    "percentile above 100": {"uri": CALIBRATION_URI, "method": "percentile", "percentile": 150},
    "percentile not a number": {"uri": CALIBRATION_URI, "method": "percentile", "percentile": "high"},
}


@pytest.mark.parametrize("name", sorted(CALIBRATIONS_REJECTED))
def test_malformed_calibration_is_rejected_by_the_generated_crd(name: str) -> None:
    assert md_validator().is_valid(md_body())
    assert not md_validator().is_valid(md_body(optimization={"calibration": CALIBRATIONS_REJECTED[name]}))


def test_the_generated_crd_requires_calibration_for_int8_with_a_cel_rule_saying_what_to_give() -> None:
    spec = generated_crd("modeldeployments")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if r["message"] == crds.INT8_NEEDS_CALIBRATION]
    assert "spec.optimization.calibration.uri" in rule["message"] and "--calibration" in rule["message"]
    # The rule reads what it must: each target's precision, the default precision, the calibration.
    for part in ("self.targets.exists", "t.precision", "self.optimization.precision", "'int8'",
                 f"'{crds.DEFAULT_PRECISION_GPU}'", f"'{crds.DEFAULT_PRECISION_CPU}'",
                 "has(self.optimization.calibration)"):
        assert part in rule["rule"]
    calibration = spec["properties"]["optimization"]["properties"]["calibration"]
    assert calibration["required"] == ["uri"]
    assert calibration["properties"]["method"]["enum"] == ["minmax", "percentile", "entropy"]
    assert calibration["properties"]["method"]["default"] == "minmax"  # `kubetrt lower`'s
    assert calibration["properties"]["holdoutFraction"]["default"] == 0.2
    assert "self < 1.0" in calibration["properties"]["holdoutFraction"]["x-kubernetes-validations"][0]["rule"]
    # JSON schema alone cannot say it: the CEL rule (and the operator's mirror of it) must.
    assert md_validator().is_valid(without_calibration(md_body()))


# ----------------------------------------------------------------------------- the operator's check
def test_int8_target_without_calibration_is_refused_with_the_message() -> None:
    (error,) = errors(without_calibration(md_body()))
    assert error.startswith(crds.INT8_NEEDS_CALIBRATION) and error.endswith("(int8 targets: t4)")


def test_default_precision_int8_needs_calibration_for_targets_without_their_own() -> None:
    md = md_body(optimization={"precision": "int8"})
    md["spec"]["targets"][0]["precision"] = "fp16"  # h100 builds fp16; t4 and cpu take the int8 default
    (error,) = errors(md)
    assert error.endswith("(int8 targets: t4, cpu)")
    md["spec"]["targets"] = [md["spec"]["targets"][0]]
    assert errors(md) == [], "no target builds int8: nothing to calibrate"


def test_fp16_only_deployment_needs_no_calibration() -> None:
    md = without_calibration(md_body())
    md["spec"]["targets"][1]["precision"] = "fp16"
    assert errors(md) == []


@pytest.mark.parametrize("calibration,message", [
    ({"uri": CALIBRATION_URI, "method": "entropy", "percentile": 99.9}, crds.PERCENTILE_NEEDS_METHOD),
    ({"uri": CALIBRATION_URI, "holdoutFraction": 0}, crds.HOLDOUT_FRACTION_RANGE),
    ({"uri": CALIBRATION_URI, "holdoutFraction": 1.0}, crds.HOLDOUT_FRACTION_RANGE),
    ({"uri": CALIBRATION_URI, "method": "percentile", "percentile": 0}, crds.PERCENTILE_RANGE),
])
def test_the_operator_mirrors_the_calibration_cel_rules(calibration: dict[str, Any], message: str) -> None:
    md = md_body(optimization={"calibration": calibration})
    assert md_validator().is_valid(md), "only CEL (or the operator) rejects this"
    assert errors(md) == [message]
    rules = {r["message"] for sub in _schemas(crds.model_deployment_spec_schema())
             for r in sub.get("x-kubernetes-validations", [])}
    assert message in rules, "the operator's message is the CEL rule's"


def _schemas(schema: dict[str, Any]) -> list[dict[str, Any]]:
    out = [schema]
    for sub in schema.get("properties", {}).values():
        out += _schemas(sub)
    if "items" in schema:
        out += _schemas(schema["items"])
    return out


def test_reconcile_of_int8_without_calibration_creates_nothing_and_says_why() -> None:
    plan = reconcile.plan_model_deployment(without_calibration(md_body()), Observed(), CONFIG, NOW)
    assert (plan.create, plan.apply) == ([], [])
    degraded = next(c for c in plan.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert crds.INT8_NEEDS_CALIBRATION in degraded["message"]


# ----------------------------------------------------------------------------- EngineBuild and Job
def _builds(md: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {eb["spec"]["target"]["name"]: eb for eb in reconcile.plan_model_deployment(md, Observed(), CONFIG, NOW).create}


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_int8_engine_build_and_its_job_carry_the_calibration_uri() -> None:
    builds = _builds(md_body())
    eb_validator = jsonschema.Draft7Validator(crds.object_schema(generated_crd("enginebuilds")))
    for name, eb in builds.items():
        eb_validator.validate(eb)
        command = objects.build_job(eb, CONFIG)["spec"]["template"]["spec"]["containers"][0]["command"]
        if name == "t4":
            assert eb["spec"]["model"]["calibrationURI"] == CALIBRATION_URI
            assert _flag(command, "--calibration") == CALIBRATION_URI
            assert build_parser().parse_args(command[1:]).calibration == CALIBRATION_URI
        else:  # fp16 targets build from model.onnx: calibration is not theirs
            assert "calibrationURI" not in eb["spec"]["model"] and "--calibration" not in command


def test_other_calibration_data_is_another_int8_engine_but_the_same_fp16_engine() -> None:
    a = _builds(md_body())
    b = _builds(md_body(optimization={"calibration": {"uri": "gs://datasets/resnet50/other"}}))
    assert a["t4"]["metadata"]["name"] != b["t4"]["metadata"]["name"]
    assert a["h100"]["metadata"]["name"] == b["h100"]["metadata"]["name"]
    assert a["cpu"]["metadata"]["name"] == b["cpu"]["metadata"]["name"]


# ----------------------------------------------------------------------------- the real operator on kmock
async def test_operator_refuses_int8_without_calibration_with_a_failed_condition(
        api: ApiServerEmulator, client: KubeClient, operator: Any) -> None:  # noqa: F811
    await asyncio.to_thread(client.create, without_calibration(md_body()))
    degraded = await eventually(lambda: (condition(api, "resnet", "Degraded") or {}).get("status") == "True"
                                and condition(api, "resnet", "Degraded"))
    assert degraded["reason"] == "InvalidSpec" and crds.INT8_NEEDS_CALIBRATION in degraded["message"]
    ready = condition(api, "resnet", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    await asyncio.sleep(0.3)
    assert not objs(api, "enginebuilds") and not objs(api, "jobs")


async def test_operator_passes_the_calibration_uri_to_the_int8_build_job(
        api: ApiServerEmulator, client: KubeClient, operator: Any) -> None:  # noqa: F811
    await asyncio.to_thread(client.create, md_body())
    jobs = await eventually(lambda: len(objs(api, "jobs")) == 3 and objs(api, "jobs"))
    builds = {eb["spec"]["target"]["name"]: eb for eb in objs(api, "enginebuilds").values()}
    assert builds["t4"]["spec"]["model"]["calibrationURI"] == CALIBRATION_URI
    assert "calibrationURI" not in builds["h100"]["spec"]["model"]
    commands = {j["metadata"]["labels"][names.LABEL_TARGET]: j["spec"]["template"]["spec"]["containers"][0]["command"]
                for j in jobs.values()}
    assert _flag(commands["t4"], "--calibration") == CALIBRATION_URI
    assert "--calibration" not in commands["h100"] and "--calibration" not in commands["cpu"]
