"""Driving a runtime choice between two ways (omp.TeamChoice, primitive_chain.BandsChoice) with
made-up times: each call picks a way and records the time given for it."""
from __future__ import annotations

from typing import Protocol


class TwoWayChoice(Protocol):
    def pick(self) -> bool: ...
    def record(self, way: bool, seconds: float) -> object: ...


def drive(choice: TwoWayChoice, false_s: float, true_s: float, calls: int) -> list[bool]:
    """The ways picked by `calls` calls, each recording `true_s` where it picked True, else `false_s`."""
    picks = []
    for _ in range(calls):
        way = choice.pick()
        choice.record(way, true_s if way else false_s)
        picks.append(way)
    return picks
