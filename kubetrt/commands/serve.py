"""`kubetrt serve PACKAGE [PACKAGE...]`: the Open Inference Protocol + TF Serving REST server."""
from __future__ import annotations

import argparse


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected a positive integer")
    return n


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value}: expected a non-negative integer")
    return n


def _sizes(value: str) -> tuple[int, ...]:
    try:
        return tuple(_positive(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value}: expected comma-separated positive integers") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve model packages over HTTP (KServe V2 / OIP and TF Serving REST)")
    p.add_argument("packages", nargs="+", metavar="PACKAGE", help="model package directories")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--device", default="auto", choices=("auto", "host", "cuda", "tensorrt"),
                   help="device runtime; auto lets the runtime pick the best one on this node")
    p.add_argument("--engine-key", default=None, help="load this engine from the package (default: the runtime's choice)")
    p.add_argument("--max-batch-size", type=_positive, default=32, help="1 turns dynamic batching off")
    p.add_argument("--max-queue-delay-us", type=_non_negative, default=500,
                   help="longest a request waits for others to batch with while traffic is concurrent")
    p.add_argument("--preferred-batch-sizes", type=_sizes, default=(), metavar="N[,N...]")
    p.add_argument("--max-queue-size", type=_positive, default=1024,
                   help="requests queued per model before answering 503 + Retry-After")
    p.add_argument("--batch-workers", type=_positive, default=1, help="compute threads per model")
    p.add_argument("--request-timeout-s", type=float, default=30.0, help="per-request deadline")
    p.add_argument("--max-body-bytes", type=_positive, default=64 << 20, help="larger request bodies get 413")
    p.add_argument("--graceful-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish")
    p.add_argument("--no-golden-check", action="store_true",
                   help="mark models ready without reproducing their golden outputs (not for production)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kubetrt.runtime.batcher import BatcherConfig
    from kubetrt.serving.app import create_app
    from kubetrt.serving.registry import ServingConfig
    from kubetrt.serving.server import serve, uvicorn_config

    config = ServingConfig(
        device=args.device,
        engine_key=args.engine_key,
        batcher=BatcherConfig(
            max_batch_size=args.max_batch_size,
            max_queue_delay_us=args.max_queue_delay_us,
            preferred_batch_sizes=args.preferred_batch_sizes,
            max_queue_size=args.max_queue_size,
            workers=args.batch_workers,
        ),
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        golden_check=not args.no_golden_check,
    )
    app = create_app(args.packages, config)  # reads every manifest now: a bad path fails before binding
    return serve(uvicorn_config(app, args.host, args.port, verbose=args.verbose,
                                graceful_timeout_s=args.graceful_timeout_s))
