"""`kubetrt demo`: SavedModel -> pipeline -> verified engine -> served -> real requests, no cluster."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the whole flow locally on an example model and send it requests")
    p.add_argument("--savedmodel", default=None, help="use this SavedModel (path or URI) instead of the example CNN")
    p.add_argument("--workdir", default=None, help="keep everything here (default: a temp directory, removed after)")
    p.add_argument("--store", default=None, help="engine store URI (default: <workdir>/store)")
    p.add_argument("--no-kfp", action="store_true", help="call the stages in-process instead of a kfp.local run")
    p.add_argument("--no-serve", action="store_true", help="predict in-process instead of starting kubetrt serve")
    p.add_argument("--requests", type=int, default=20, help="inference requests to send (default: 20)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from kubetrt.pipeline.demo import run_demo

    os.environ.setdefault("KUBETRT_PROGRESS", "1")  # the demo is interactive: always show progress
    if args.requests < 1:
        raise ValueError(f"--requests {args.requests}: expected at least 1")
    if args.workdir:
        run_demo(args.workdir, savedmodel=args.savedmodel, store=args.store, use_kfp=not args.no_kfp,
                 requests=args.requests, serve=not args.no_serve)
        return 0
    with tempfile.TemporaryDirectory(prefix="kubetrt-demo-") as tmp:
        run_demo(tmp, savedmodel=args.savedmodel, store=args.store, use_kfp=not args.no_kfp,
                 requests=args.requests, serve=not args.no_serve, kept=False)
    return 0
