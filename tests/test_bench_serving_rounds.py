"""bench/serving.py --rounds: how one cell's rounds become the cell it prints."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import file_modules

REPO = Path(__file__).resolve().parents[1]
serving = file_modules.load("kubetrt_bench_serving", REPO / "bench" / "serving.py")


def cell(rps: float, p50: float, p99: float, *, errors: int = 0, in_server: float = float("nan"),
         missing: str = "") -> Any:
    return serving.Cell("kubetrt", "mobilenet_v2", "grpc", 1, rps=rps, p50_ms=p50, p99_ms=p99, ok=int(rps),
                        errors=errors, in_server_ms=in_server, missing=missing)


def test_a_spell_in_one_round_does_not_set_the_cell():
    """The median round of three: one slow round (a noisy spell of the machine) is outvoted."""
    out = serving.combine_rounds([cell(230.0, 4.3, 6.0), cell(160.0, 6.2, 18.0), cell(226.0, 4.4, 5.8)])
    assert (out.rps, out.p50_ms, out.p99_ms) == (226.0, 4.4, 6.0)


def test_counts_add_up_over_the_rounds():
    out = serving.combine_rounds([cell(200.0, 4.0, 5.0, errors=1), cell(210.0, 4.1, 5.1, errors=2)])
    assert out.errors == 3 and out.ok == 410


def test_a_timing_unknown_in_a_round_is_left_out_of_its_median():
    out = serving.combine_rounds([cell(200.0, 4.0, 5.0, in_server=3.9), cell(210.0, 4.1, 5.1)])
    assert out.in_server_ms == 3.9
    assert math.isnan(serving.combine_rounds([cell(200.0, 4.0, 5.0)]).in_server_ms)


def test_a_round_not_measured_leaves_the_cell_unmeasured_with_its_reason():
    out = serving.combine_rounds([cell(200.0, 4.0, 5.0), cell(0.0, 0.0, 0.0, missing="server died")])
    assert out.missing == "server died"
    assert math.isnan(out.rps)
