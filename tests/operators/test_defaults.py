"""One default per setting: what the CRD fills in for an unset field is what the CLI does for an
unset flag (the operator passes the CRD's value as that flag, a user runs the CLI without it).

SETTINGS is the table both sides are read from; `crd_default` and `cli_default` read one side
each, so a check of the documentation's defaults can reuse the table and the readers.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import pytest

from kubetrt.cli.main import build_parser
from kubetrt.operators import crds
from kubetrt.runtime.target import BatchProfile, parse_target


@dataclass(frozen=True)
class Setting:
    crd: str  # dotted path under the ModelDeployment's spec (or "eb:" + path under an EngineBuild's)
    command: tuple[str, ...]  # the CLI subcommand(s), e.g. ("serve",) or ("pipeline", "run")
    flag: str  # its option string


SETTINGS = [
    Setting("batching.maxBatchSize", ("serve",), "--max-batch-size"),
    Setting("batching.maxQueueDelayMicroseconds", ("serve",), "--max-queue-delay-us"),
    Setting("batching.maxQueueSize", ("serve",), "--max-queue-size"),
    Setting("batching.requestTimeoutSeconds", ("serve",), "--request-timeout-s"),
    Setting("tracing.rate", ("serve",), "--trace-rate"),
    Setting("optimization.calibration.method", ("lower",), "--calibration-method"),
    Setting("optimization.calibration.method", ("pipeline", "run"), "--calibration-method"),
    Setting("optimization.calibration.holdoutFraction", ("lower",), "--holdout"),
    Setting("model.version", ("lower",), "--version"),
    Setting("model.version", ("pipeline", "run"), "--version"),
    Setting("model.signature", ("lower",), "--signature"),
    Setting("model.signature", ("pipeline", "run"), "--signature"),
    Setting("eb:model.version", ("lower",), "--version"),
    Setting("eb:model.signature", ("lower",), "--signature"),
]


def crd_default(path: str) -> Any:
    """The default the CRD schema gives the field at ``path`` (KeyError: the field has none)."""
    schema = crds.model_deployment_spec_schema()
    if path.startswith("eb:"):
        schema, path = crds.engine_build_spec_schema(), path[3:]
    for part in path.split("."):
        schema = schema["properties"][part]
    return schema["default"]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = action.choices[name]
    return sub


def cli_default(command: tuple[str, ...], flag: str) -> Any:
    """The default of ``flag`` of ``kubetrt COMMAND...``, as its parser has it."""
    parser = build_parser()
    for name in command:
        parser = _subparser(parser, name)
    return next(a.default for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s.crd}={' '.join(s.command)} {s.flag}")
def test_crd_and_cli_defaults_agree(setting: Setting) -> None:
    assert crd_default(setting.crd) == cli_default(setting.command, setting.flag)


def test_a_targets_precision_and_batch_profile_default_as_the_cli_target_spec() -> None:
    """`kubetrt build --target host` and a CRD target with nothing set build the same engine."""
    for cpu, spec in ((True, "host"), (False, "tensorrt@Tesla-T4")):
        assert crds.default_precision(cpu) == parse_target(spec).precision, spec
    profile = parse_target("host").profile
    assert {k: crd_default(f"optimization.batchProfile.{k}") for k in ("min", "opt", "max")} == {
        "min": profile.min, "opt": profile.opt, "max": profile.max}
    assert crd_default("optimization.maxBatchSize") == crd_default("eb:target.maxBatchSize") == BatchProfile().max
    assert crd_default("batching.maxBatchSize") == BatchProfile().max, "the batcher fills the engine's largest batch"


@pytest.mark.parametrize("command", [("serve",), ("build",), ("lower",), ("fetch",), ("pipeline", "run")])
def test_help_shows_every_default(command: tuple[str, ...]) -> None:
    parser = build_parser()
    for name in command:
        parser = _subparser(parser, name)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, (), [], "", argparse.SUPPRESS):
            assert "default" in (formatter._get_help_string(action) or ""), (command, action.option_strings)
    if command == ("serve",):
        assert "(default: 32)" in " ".join(parser.format_help().split())


@pytest.mark.parametrize("seconds", [0, -2, 86401])
def test_the_operator_refuses_a_request_timeout_the_crd_refuses(seconds: float) -> None:
    from kubetrt.operators import objects
    from operator_testlib import md_body

    spec = objects.normalized_spec(md_body(batching={"requestTimeoutSeconds": seconds}))
    assert objects.validate_spec(spec) == [crds.REQUEST_TIMEOUT_POSITIVE]
    assert objects.validate_spec(objects.normalized_spec(md_body(batching={"requestTimeoutSeconds": 0.5}))) == []
