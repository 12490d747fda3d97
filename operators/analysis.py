"""Canary analysis (pure): the serving pods' Prometheus text in, a verdict out.

The operator reads each canary pod's `/metrics` (serving/metrics.py): request counts by outcome
and the request latency histogram. Counters start at zero with each pod, so a canary pod's
counters are what it served since it started.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

REQUESTS = "kubetrt_inference_requests_total"
LATENCY_BUCKET = "kubetrt_request_duration_seconds_bucket"
# Outcomes that are the server's fault; a client's bad request or unknown model is not the canary's.
ERROR_OUTCOMES = frozenset({"error", "unavailable", "overloaded", "timeout"})
IGNORED_OUTCOMES = frozenset({"bad_request", "not_found", "too_large"})

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsError(ValueError):
    """Text that is not Prometheus exposition format."""


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of Prometheus text; comments and blanks skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise MetricsError(f"line {n}: {line[:80]!r}: expected 'name{{labels}} value'")
        try:
            value = float(m.group(3))
        except ValueError:
            raise MetricsError(f"line {n}: {m.group(3)!r}: expected a number") from None
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


@dataclass
class CanaryMetrics:
    """What the canary's pods served, summed over pods: requests by outcome and the latency
    histogram's cumulative bucket counts by upper bound (seconds)."""

    outcomes: dict[str, float] = field(default_factory=dict)
    buckets: dict[float, float] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return int(sum(v for k, v in self.outcomes.items() if k not in IGNORED_OUTCOMES))

    @property
    def errors(self) -> int:
        return int(sum(v for k, v in self.outcomes.items() if k in ERROR_OUTCOMES))

    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def p99_ms(self) -> float | None:
        """The 99th percentile's bucket upper bound in milliseconds (None without samples); a
        request past the last finite bucket reads as infinite."""
        total = self.buckets.get(math.inf, 0.0)
        if total <= 0:
            return None
        for le in sorted(self.buckets):
            if self.buckets[le] >= 0.99 * total:
                return le * 1000.0
        return math.inf


def canary_metrics(texts: Iterable[str], model: str | None = None) -> CanaryMetrics:
    """Sum the canary pods' metrics (of ``model`` only, when given)."""
    out = CanaryMetrics()
    for text in texts:
        for name, labels, value in parse_samples(text):
            if model is not None and labels.get("model") not in (model, None):
                continue
            if name == REQUESTS:
                outcome = labels.get("outcome", "")
                out.outcomes[outcome] = out.outcomes.get(outcome, 0.0) + value
            elif name == LATENCY_BUCKET:
                le = math.inf if labels.get("le") in ("+Inf", "Inf") else float(labels.get("le", "nan"))
                out.buckets[le] = out.buckets.get(le, 0.0) + value
    return out


@dataclass(frozen=True)
class Verdict:
    """``state``: Pass (promote), Fail (roll back), or Wait; ``reason`` and ``message`` name what
    was measured against which bound."""

    state: str
    reason: str
    message: str


PASS, FAIL, WAIT = "Pass", "Fail", "Wait"


def verdict(analysis: Mapping[str, Any], metrics: CanaryMetrics, elapsed_seconds: float) -> Verdict:
    """Judge a canary whose pods have all been ready for ``elapsed_seconds``.

    Errors or p99 over their bound fail it as soon as ``minRequests`` requests were served (fewer
    prove nothing either way); a canary within bounds passes once its window is over with at
    least ``minRequests``; until then it waits (a canary that gets no traffic waits)."""
    window = float(analysis.get("windowSeconds", 60))
    need = int(analysis.get("minRequests", 1))
    n, rate, p99 = metrics.requests, metrics.error_rate(), metrics.p99_ms()
    seen = f"{metrics.errors} error(s) in {n} request(s)"
    if n >= max(need, 1):
        max_rate = analysis.get("maxErrorRate")
        if max_rate is not None and rate > float(max_rate):
            return Verdict(FAIL, "ErrorRate", f"canary error rate {rate:.1%} ({seen}) over maxErrorRate "
                                              f"{float(max_rate):.1%}")
        max_p99 = analysis.get("maxP99Milliseconds")
        if max_p99 is not None and p99 is not None and p99 > float(max_p99):
            return Verdict(FAIL, "Latency", f"canary p99 latency {p99:g} ms (bucket bound, {n} requests) over "
                                            f"maxP99Milliseconds {float(max_p99):g}")
    if elapsed_seconds < window:
        return Verdict(WAIT, "Analyzing", f"canary analysis: {seen} after {elapsed_seconds:.0f}s of {window:.0f}s")
    if n < need:
        return Verdict(WAIT, "TooFewRequests", f"canary analysis: {n} of minRequests {need} request(s) after "
                                               f"{elapsed_seconds:.0f}s")
    p99_text = "no latency samples" if p99 is None else f"p99 {p99:g} ms"
    return Verdict(PASS, "AnalysisPassed", f"canary held for {window:.0f}s: {seen}, {p99_text}")
