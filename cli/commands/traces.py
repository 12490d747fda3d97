"""`kubetrt traces`: per model, where traced calls spent their time (serving/trace_summary.py)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "traces", help="summarize request traces (kubetrt serve --trace-file, or a pod's log with spec.tracing)",
        description="Per model: each stage's p50/p90/p99 over the traced calls read from FILEs or standard input, "
                    "e.g. `kubectl logs POD -c serving | kubetrt traces`. Lines that are no trace are skipped.")
    p.add_argument("files", nargs="*", metavar="FILE", help="trace files or logs ('-' or none: standard input)")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kubetrt.serving.trace_summary import PERCENTILES, Traces, read_traces, render, summarize

    found = Traces()
    for name in args.files or ["-"]:
        if name == "-":
            part = read_traces(sys.stdin)
        else:
            try:
                with open(name, encoding="utf-8", errors="replace") as f:
                    part = read_traces(f)
            except OSError as e:
                raise FileNotFoundError(f"trace file {name}: {e.strerror}") from None
        found.calls += part.calls
        found.unreadable += part.unreadable
    summaries = summarize(found.calls)
    if args.json:
        print(json.dumps({"percentiles": list(PERCENTILES), "unreadable": found.unreadable,
                          "models": [asdict(s) for s in summaries]}, indent=2))
    else:
        print(render(summaries, found.unreadable))
    return 0 if summaries else 1
