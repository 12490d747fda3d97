"""runtime/target.py, the one codec of targets: the spec string and the JSON object round-trip, and
what each rejects is named with what was expected."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubetrt.runtime.target import BACKENDS, CPU_PRODUCT, PRECISIONS, BatchProfile, Target, TargetError, parse_target

PRODUCTS = ["NVIDIA-H100-80GB-HBM3", "Tesla-T4", "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"]


@st.composite
def targets(draw: st.DrawFn) -> Target:
    backend = draw(st.sampled_from(BACKENDS))
    product = CPU_PRODUCT if backend == "host" else draw(st.sampled_from(PRODUCTS))
    lo, opt, hi = sorted(draw(st.lists(st.integers(1, 4096), min_size=3, max_size=3)))
    return Target(backend, product, draw(st.sampled_from(PRECISIONS)), BatchProfile(lo, opt, hi))


@given(targets())
def test_spec_string_round_trips(target: Target) -> None:
    assert parse_target(target.spec()) == target


@given(targets(), st.sampled_from(["8.0", "9.0"]), st.sampled_from(["numpy2.1", "10.3.0"]))
def test_json_round_trips_resolved_targets(target: Target, cc: str, version: str) -> None:
    resolved = target.resolve(cc if target.is_gpu else None, version)
    back = Target.from_json(json.loads(json.dumps(resolved.to_json())))
    assert back == resolved and back.key() == resolved.key()


def test_spec_defaults_depend_on_the_backend() -> None:
    assert parse_target("host") == Target()
    assert parse_target("host").spec() == "host:fp32:1/8/32"
    assert parse_target("tensorrt@Tesla-T4").spec() == "tensorrt@Tesla-T4:fp16:1/8/32"


def test_json_without_optional_fields_takes_the_defaults() -> None:
    assert Target.from_json({"backend": "host"}) == Target()
    old = {"backend": "cuda", "gpu_product": "Tesla-T4", "precision": "fp16", "profile": {"max": "64"}}
    assert Target.from_json(old) == Target("cuda", "Tesla-T4", "fp16", BatchProfile(max=64))


@pytest.mark.parametrize("d,expected", [
    ({"gpu_product": "Tesla-T4"}, "expected a 'backend' field"),
    ({"backend": "host", "profile": [1, 8, 32]}, "expected an object with min, opt and max"),
    ({"backend": "host", "profile": {"min": "one"}}, "profile min 'one': expected an integer"),
    ({"backend": "host", "profile": {"opt": True}}, "profile opt True: expected an integer"),
    ({"backend": "warp"}, "backend 'warp': expected one of host, cuda, tensorrt"),
    ({"backend": "host", "profile": {"min": 9, "opt": 8}}, "expected 1 <= min <= opt <= max"),
])
def test_bad_json_names_what_was_expected(d: dict[str, object], expected: str) -> None:
    with pytest.raises(TargetError, match=expected):
        Target.from_json(d)
