"""Fault injection (serving/faults.py): off by default; a set rate fails that share of calls,
evenly, as the `error` outcome; a bad setting names itself."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kubetrt.serving import calls, faults
from kubetrt.serving.metrics import ServingMetrics
from kubetrt.serving.registry import ServingConfig


def test_off_unless_the_environment_sets_a_rate() -> None:
    assert faults.from_env({}) is None
    assert faults.from_env({faults.ENV_ERROR_RATE: ""}) is None
    assert faults.from_env({faults.ENV_ERROR_RATE: "0"}) is None


@pytest.mark.parametrize("rate,calls_n,want", [(0.5, 10, 5), (0.25, 8, 2), (1.0, 3, 3), (0.1, 30, 3)])
def test_a_rate_fails_that_share_evenly(rate: float, calls_n: int, want: int) -> None:
    injector = faults.FaultInjector(rate)
    failed = []
    for i in range(calls_n):
        try:
            injector.check()
        except faults.InjectedFault:
            failed.append(i)
    assert len(failed) == want
    if rate == 0.5:
        assert failed == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("raw", ["1.5", "-0.1", "half", "nan"])
def test_a_bad_rate_names_the_setting_and_what_is_expected(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{faults.ENV_ERROR_RATE}=.*expected a fraction from 0 to 1"):
        faults.from_env({faults.ENV_ERROR_RATE: raw})


def test_injected_faults_count_as_errors_in_the_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = ServingMetrics().for_model("m")
    served = SimpleNamespace(metrics=metrics, config=ServingConfig(), traces=None)
    monkeypatch.setattr(calls, "FAULTS", faults.FaultInjector(0.5))

    async def ok() -> str:
        return "ok"

    async def run() -> list[str]:
        out = []
        for _ in range(4):
            try:
                out.append(await calls.tracked(served, ok))  # type: ignore[arg-type]
            except faults.InjectedFault as e:
                assert e.status == 500
                out.append("fault")
        return out
    assert asyncio.run(run()) == ["ok", "fault", "ok", "fault"]
    metrics.fold()  # as a scrape does
    assert metrics.outcome["error"]._value.get() == 2 and metrics.outcome["success"]._value.get() == 2
