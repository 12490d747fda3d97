"""The contract between the operator and the pods it creates: every flag it passes is one the pod's
command accepts, and every KUBETRT_* variable it sets is read by the code the pod runs.

The effects themselves are observed elsewhere (tests/serving/test_serve_cli.py, tests/e2e/);
this keeps a setting from being added on one side only.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kubetrt.cli import build_parser
from kubetrt.operators import crds, names, objects, reconcile
from kubetrt.operators.reconcile import Observed
from kubetrt.runtime.target import BatchProfile, Target, parse_target
from operator_testlib import CONFIG, md_body

REPO = Path(__file__).resolve().parents[2]
POD_CODE = [REPO / d for d in ("kubetrt", "runtime", "serving", "pipeline")]


def generated_containers() -> list[dict[str, Any]]:
    md = md_body(batching={"maxBatchSize": 16, "maxQueueDelayMicroseconds": 900, "preferredBatchSizes": [4, 8],
                           "maxQueueSize": 40, "requestTimeoutSeconds": 2.5}, tracing={"rate": 50})
    spec = objects.normalized_spec(md)
    eb = reconcile.plan_model_deployment(md, Observed(), CONFIG, "2026-01-01T00:00:00Z").create[1]
    eb["status"] = {"engineKey": "some-key", "phase": "Succeeded", "verified": True}
    target = objects.resolve_target(spec, spec["targets"][1])
    job = objects.build_job(eb, CONFIG)
    dep = objects.serving_deployment(md, spec, target, eb, CONFIG)
    return [job["spec"]["template"]["spec"]["containers"][0], dep["spec"]["template"]["spec"]["containers"][0]]


@pytest.mark.parametrize("index,command", [(0, "build"), (1, "serve")])
def test_every_generated_flag_is_accepted_by_the_pods_command(index: int, command: str) -> None:
    c = generated_containers()[index]
    assert c["command"][:2] == ["kubetrt", command]
    args = build_parser().parse_args(c["command"][1:])  # argparse exits on any flag it does not know
    if command == "build":  # the Job builds exactly the EngineBuild's target, as `kubetrt build` reads it
        assert parse_target(args.target) == Target(backend="tensorrt", gpu_product="Tesla-T4", precision="int8",
                                                   profile=BatchProfile(1, 8, 32))
        assert (args.package, args.store) == ("s3://models/resnet50/pkg", "s3://engines/resnet50")
    if command == "serve":
        assert (args.engine_key, args.model_name, args.max_batch_size, args.preferred_batch_sizes) == \
            ("some-key", "resnet50", 16, (4, 8))
        assert args.max_queue_delay_us == 900 and args.cache_dir == objects.CACHE_DIR
        assert (args.max_queue_size, args.request_timeout_s) == (40, 2.5)
        assert (args.trace_file, args.trace_rate) == (names.TRACE_PATH, 50)


def test_serving_traces_only_where_the_spec_asks() -> None:
    """spec.tracing unset: no call traced; set empty: the CRD's default rate, written to the pod's stdout."""
    def serve_args(**spec: Any) -> Any:
        md = md_body(**spec)
        norm = objects.normalized_spec(md)
        eb = reconcile.plan_model_deployment(md, Observed(), CONFIG, "2026-01-01T00:00:00Z").create[1]
        eb["status"] = {"engineKey": "some-key", "phase": "Succeeded", "verified": True}
        dep = objects.serving_deployment(md, norm, objects.resolve_target(norm, norm["targets"][1]), eb, CONFIG)
        return build_parser().parse_args(dep["spec"]["template"]["spec"]["containers"][0]["command"][1:])

    assert serve_args().trace_file is None
    traced = serve_args(tracing={})
    assert (traced.trace_file, traced.trace_rate) == (names.TRACE_PATH, crds.DEFAULT_TRACE_RATE)


def test_every_kubetrt_variable_the_operator_sets_is_read_by_pod_code() -> None:
    names = {e["name"] for c in generated_containers() for e in c["env"] if e["name"].startswith("KUBETRT_")}
    assert names, "the serving pods get their thread counts from the Downward API"
    source = "\n".join(p.read_text() for d in POD_CODE for p in d.rglob("*.py"))
    unread = sorted(n for n in names if not re.search(rf"""(environ\.get|getenv|threads_from_env)\(\s*["']{n}["']""", source))
    assert not unread, f"set by the operator but read by nothing in the pod: {unread}"
