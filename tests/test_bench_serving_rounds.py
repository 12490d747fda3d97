"""bench/serving.py: how one cell's rounds become the cell it prints (--rounds), and how an h2load
run's output becomes a gRPC cell's counts and latencies."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import file_modules
import pytest

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


# h2load's summary and log as nghttp2 1.52 prints them: a timed run at four connections against
# kubetrt serve (MobileNetV2, 4,048 bytes of DATA an answer) and three calls naming no model.
H2LOAD_TIMED = """finished in 2.00s, 123.00 req/s, 500.61KB/s
requests: 246 total, 250 started, 246 done, 246 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 246 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 1001.21KB (1025240) total, 18.26KB (18696) headers (space savings 3.80%), 972.47KB (995808) data
"""
H2LOAD_FAILED = """finished in 2.96ms, 1012.15 req/s, 192.08KB/s
requests: 3 total, 3 started, 3 done, 3 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 3 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 583B (583) total, 507B (507) headers (space savings -1.81%), 0B (0) data
"""


def h2load_log(latencies_us: list[int]) -> str:
    return "".join(f"{1796023706258385 + i * 1000}\t200\t{us}\n" for i, us in enumerate(latencies_us))


def test_an_h2load_run_reads_as_its_data_bytes_seconds_and_answered_calls():
    run = serving.read_h2load(H2LOAD_TIMED, h2load_log([8000] * 246))
    assert (run.data_bytes, run.seconds, len(run.answered_us)) == (995808, 2.0, 246)
    assert serving.grpc_outcomes(run, 4048) == (246, 0)


def test_calls_answered_with_a_grpc_error_carry_no_message_and_count_as_not_ok():
    run = serving.read_h2load(H2LOAD_FAILED, h2load_log([1045, 680, 527]))
    assert run.seconds == 2.96e-3
    assert serving.grpc_outcomes(run, 4048) == (0, 3)


def test_in_a_mixed_run_only_the_answer_messages_count_as_ok():
    mixed = H2LOAD_TIMED.replace("(995808) data", f"({4048 * 240}) data")
    assert serving.grpc_outcomes(serving.read_h2load(mixed, h2load_log([8000] * 246)), 4048) == (240, 6)


def test_a_call_refused_at_the_http_level_is_no_answer():
    log = h2load_log([8000, 9000]) + "1796023706260196\t415\t310\n"  # a server that takes no gRPC there
    assert serving.read_h2load(H2LOAD_TIMED, log).answered_us == [8000.0, 9000.0]


def test_h2load_without_its_summary_is_an_error_that_shows_its_output():
    with pytest.raises(RuntimeError, match="h2load printed no summary: connect failed"):
        serving.read_h2load("connect failed", "")
