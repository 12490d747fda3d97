"""Where traced calls spent their time, stage by stage and per model: the lines request_trace.py
writes, read back as a user reads a pod's log (`kubectl logs POD | kubetrt traces`), so that nobody
has to subtract stamps by hand to see whether a call waited, computed or answered slowly.

A log holds other lines beside the traces (a pod's log lines, a file someone appended to); only
JSON objects with a `timestamps` list count, and a line that starts as one but does not parse (a
log cut off mid-line) is counted as unreadable, not fatal.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from .request_trace import COMPUTE_END, COMPUTE_START, QUEUE_START, REQUEST_END, REQUEST_START

# (name, from stamp, to stamp): a call's path through the server, then the whole of it
STAGES = (
    ("to the batcher", REQUEST_START, QUEUE_START),  # the request read and decoded, its inputs checked
    ("queued", QUEUE_START, COMPUTE_START),  # waiting for the engine (or a batch to form)
    ("compute", COMPUTE_START, COMPUTE_END),  # its batch's run, hand-offs to and from the run thread included
    ("answer", COMPUTE_END, REQUEST_END),  # outputs encoded, up to the handler's end
    ("whole call", REQUEST_START, REQUEST_END),
)
PERCENTILES = (50, 90, 99)


@dataclass
class Traces:
    """The calls read from a log, and what was not one."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0  # lines that looked like a trace and did not parse


def read_traces(lines: Iterable[str]) -> Traces:
    out = Traces()
    for line in lines:
        text = line.strip()
        if not text.startswith("{"):
            continue
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            out.unreadable += 1
            continue
        if isinstance(call, dict) and isinstance(call.get("timestamps"), list):
            out.calls.append(call)
    return out


def _stamps(call: dict[str, Any]) -> dict[str, int]:
    """Each stamp's first time: a call passes each point once."""
    found: dict[str, int] = {}
    for t in call["timestamps"]:
        if isinstance(t, dict) and isinstance(t.get("ns"), int):
            found.setdefault(str(t.get("name")), t["ns"])
    return found


def nearest_rank(sorted_values: list[float], pct: float) -> float:
    """The pct-th percentile by nearest rank: a value some call really took."""
    return sorted_values[max(0, math.ceil(pct / 100 * len(sorted_values)) - 1)]


@dataclass(frozen=True)
class StageTimes:
    stage: str
    calls: int  # calls that passed both of its stamps
    percentiles_us: tuple[float, ...]  # PERCENTILES, in microseconds


@dataclass(frozen=True)
class ModelSummary:
    model: str
    version: str
    outcomes: dict[str, int]
    stages: list[StageTimes]


def summarize(calls: Iterable[dict[str, Any]]) -> list[ModelSummary]:
    """Per model and version (in the order first seen): outcomes, and each stage's percentiles over
    the calls that have both its stamps (a call refused before the batcher has only the whole call)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for call in calls:
        groups.setdefault((str(call.get("model")), str(call.get("version"))), []).append(call)
    out = []
    for (model, version), group in groups.items():
        stamped = [_stamps(c) for c in group]
        stages = []
        for name, start, end in STAGES:
            took = sorted((s[end] - s[start]) / 1e3 for s in stamped if start in s and end in s)
            if took:
                stages.append(StageTimes(name, len(took), tuple(nearest_rank(took, p) for p in PERCENTILES)))
        out.append(ModelSummary(model, version, dict(Counter(str(c.get("outcome")) for c in group)), stages))
    return out


def render(summaries: list[ModelSummary], unreadable: int = 0) -> str:
    """The summaries as a table, a block per model."""
    if not summaries:
        return "no traced calls found (kubetrt serve --trace-file, or a ModelDeployment's spec.tracing)"
    head = f"  {'stage':<16}{'calls':>8}" + "".join(f"{f'p{p} us':>12}" for p in PERCENTILES)
    lines = []
    for s in summaries:
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(s.outcomes.items(), key=lambda kv: -kv[1]))
        lines += [f"{s.model} version {s.version}: {sum(s.outcomes.values())} traced calls ({outcomes})", head]
        lines += [f"  {t.stage:<16}{t.calls:>8}" + "".join(f"{v:>12.1f}" for v in t.percentiles_us) for t in s.stages]
    if unreadable:
        lines.append(f"{unreadable} line(s) looked like traces and did not parse (a log cut mid-line?)")
    return "\n".join(lines)
