"""`kubetrt traces`: a server's trace lines read back as stages per model, from a file or a pod's
log with other lines in it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from kubetrt.serving.app import create_app
from kubetrt.serving.registry import ServingConfig
from kubetrt.serving.trace_summary import PERCENTILES, STAGES, read_traces, render, summarize
from serving_support import LiveServer, cnn_input


def call_line(model: str, stamps: dict[str, int], outcome: str = "success", version: str = "1") -> str:
    return json.dumps({"id": 1, "model": model, "version": version, "outcome": outcome,
                       "timestamps": [{"name": n, "ns": ns} for n, ns in stamps.items()]})


def stamps_for(receive: int, queue: int, compute: int, answer: int) -> dict[str, int]:
    """A call's five stamps from its stages' lengths in ns (starting at 1 s)."""
    t = [1_000_000_000]
    for step in (receive, queue, compute, answer):
        t.append(t[-1] + step)
    return dict(zip(("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"), t))


def kubetrt(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kubetrt.cli", "traces", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_a_live_servers_calls_split_into_stages_that_add_up_to_the_call(cnn_package, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    config = ServingConfig(device="host", grpc_port=0, trace_file=str(path), trace_rate=1)
    x = cnn_input(1)
    with LiveServer(create_app([cnn_package], config)) as live:
        live.wait_ready()
        for _ in range(3):
            r = httpx.post(live.url + "/v2/models/small_cnn/infer", json={"inputs": [
                {"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
            assert r.status_code == 200
        bad = httpx.post(live.url + "/v2/models/small_cnn/infer", json={"inputs": [
            {"name": "image", "datatype": "FP32", "shape": [1, 2], "data": [0.0, 1.0]}]})
        assert bad.status_code == 400
    lines = path.read_text().splitlines()
    (summary,) = summarize(read_traces(lines).calls)
    assert (summary.model, summary.outcomes) == ("small_cnn", {"success": 3, "bad_request": 1})
    calls = {t.stage: t.calls for t in summary.stages}
    assert calls == {"to the batcher": 3, "queued": 3, "compute": 3, "answer": 3, "whole call": 4}, "the 400 has no run"
    # one call alone: its stages' times are its own, and they add up to the whole call
    (one,) = summarize(read_traces(lines[:1]).calls)
    times = {t.stage: t.percentiles_us[0] for t in one.stages}
    assert all(len(set(t.percentiles_us)) == 1 for t in one.stages)
    parts = sum(v for k, v in times.items() if k != "whole call")
    assert abs(parts - times["whole call"]) < 1e-6 and times["compute"] > 0, times


def test_percentiles_by_nearest_rank_per_model_and_stage() -> None:
    lines = [call_line("a", stamps_for(1_000, 0, us * 1_000, 2_000)) for us in range(1, 11)]
    lines.append(call_line("b", stamps_for(5_000, 7_000, 3_000, 1_000), version="2"))
    a, b = summarize(read_traces(lines).calls)
    compute = next(t for t in a.stages if t.stage == "compute")
    assert PERCENTILES == (50, 90, 99) and compute.percentiles_us == (5.0, 9.0, 10.0)
    assert (b.model, b.version) == ("b", "2")
    assert [(t.stage, t.percentiles_us[0]) for t in b.stages] == [
        ("to the batcher", 5.0), ("queued", 7.0), ("compute", 3.0), ("answer", 1.0), ("whole call", 16.0)]
    assert [name for name, _, _ in STAGES] == [t.stage for t in b.stages]


def test_a_pods_log_keeps_its_other_lines_and_a_cut_line_is_counted() -> None:
    log = "\n".join([
        "level=warning msg=\"model loaded\" model=cnn",
        call_line("cnn", stamps_for(10_000, 0, 40_000, 5_000)),
        '{"level": "info", "msg": "a JSON log line, no trace"}',
        call_line("cnn", stamps_for(10_000, 0, 40_000, 5_000))[:40],  # the log cut mid-line
        "",
    ])
    found = read_traces(log.splitlines())
    assert (len(found.calls), found.unreadable) == (1, 1)
    text = render(summarize(found.calls), found.unreadable)
    assert "cnn version 1: 1 traced calls (1 success)" in text and "1 line(s) looked like traces" in text


def test_the_command_reads_stdin_or_files_and_says_when_there_is_nothing(tmp_path: Path) -> None:
    lines = [call_line("cnn", stamps_for(10_000, 0, 40_000 + i * 1_000, 5_000)) for i in range(4)]
    r = kubetrt(stdin="a log line\n" + "\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    assert "cnn version 1: 4 traced calls (4 success)" in r.stdout and "compute" in r.stdout
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(lines) + "\n")
    j = kubetrt(str(f), "--json")
    assert j.returncode == 0, j.stderr
    data = json.loads(j.stdout)
    compute = next(s for s in data["models"][0]["stages"] if s["stage"] == "compute")
    assert compute["calls"] == 4 and compute["percentiles_us"] == [41.0, 43.0, 43.0]
    empty = kubetrt(stdin="no traces here\n")
    assert empty.returncode == 1 and "no traced calls found" in empty.stdout
    missing = kubetrt(str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr
