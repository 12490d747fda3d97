"""`kubetrt serve PACKAGE [PACKAGE...]`: the Open Inference Protocol + TF Serving REST server.

Every setting the operator puts into a serving pod is a flag here; packages and engines are
resolved through the servable source (kubetrt.pipeline.servable), the same as `kubetrt fetch`.
"""
from __future__ import annotations

import argparse
import functools
from typing import Any


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


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = float("nan")
    if not s > 0:
        raise argparse.ArgumentTypeError(f"{value}: expected a positive number of seconds")
    return s


def _sizes(value: str) -> tuple[int, ...]:
    try:
        return tuple(_positive(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value}: expected comma-separated positive integers") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve model packages: OIP (KServe V2) REST and gRPC, TF Serving REST")
    p.add_argument("packages", nargs="+", metavar="PACKAGE",
                   help="model packages: directories, file:// or s3:// URIs")
    add_source_arguments(p)
    p.add_argument("--model-name", default=None, help="serve the model under this name (default: the package's)")
    p.add_argument("--model-version", default=None, help="serve the model as this version (default: the package's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=8080, help="port of the REST endpoints (OIP, TF Serving, /metrics)")
    p.add_argument("--grpc-port", type=int, default=8081,
                   help="port of the OIP gRPC endpoint (inference.GRPCInferenceService); 0: any free port")
    p.add_argument("--no-grpc", action="store_true", help="serve REST only")
    p.add_argument("--shared-memory", action="store_true",
                   help="Triton's system shared memory extension: clients on this host (a sidecar in the pod) "
                        "register regions of POSIX shared memory and name them instead of sending tensors; "
                        "whoever reaches the endpoints can then have the server read and write those objects")
    p.add_argument("--device", default="auto", choices=("auto", "host", "cuda", "tensorrt"),
                   help="device runtime; auto lets the runtime pick the best one on this node")
    p.add_argument("--max-batch-size", type=_positive, default=32, help="1 turns dynamic batching off")
    p.add_argument("--max-queue-delay-us", type=_non_negative, default=0,
                   help="how long a batch formed after a busy run may wait for more requests to fill it "
                        "(a request that finds the engine idle never waits)")
    p.add_argument("--preferred-batch-sizes", type=_sizes, default=(), metavar="N[,N...]",
                   help="batch sizes the batcher prefers to form (default: none)")
    p.add_argument("--max-queue-size", type=_positive, default=1024,
                   help="requests queued per model before answering 503 + Retry-After (gRPC: RESOURCE_EXHAUSTED)")
    p.add_argument("--batch-workers", type=_positive, default=1, help="batches in flight per model")
    p.add_argument("--request-timeout-s", type=_seconds, default=30.0, help="per-request deadline")
    p.add_argument("--max-body-bytes", type=_positive, default=64 << 20, help="larger request bodies get 413")
    p.add_argument("--idle-poll-us", type=_non_negative, default=500,
                   help="after answering the last call in flight, keep polling for the next one this long before "
                        "sleeping (a woken thread costs more than a small model's run); 0: sleep at once")
    p.add_argument("--trace-file", default=None, metavar="PATH",
                   help="append one JSON line per traced call: when it started, reached the batcher, its run "
                        "started and ended, and it ended (default: no tracing)")
    p.add_argument("--trace-rate", type=_positive, default=1000, metavar="N",
                   help="with --trace-file, trace one call in N")
    p.add_argument("--graceful-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish")
    p.add_argument("--no-golden-check", action="store_true",
                   help="mark models ready without reproducing their golden outputs (not for production)")
    p.set_defaults(func=run)


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The servable-source flags `serve` and `fetch` share."""
    p.add_argument("--store", default=None, metavar="URI", help="engine store holding the verified engine (with --engine-key)")
    p.add_argument("--engine-key", default=None, metavar="KEY",
                   help="the verified engine to serve: fetched from --store, or found in the package's engines/")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="writable directory for fetched packages and engines (an emptyDir in a pod; "
                        "default: kubetrt-cache in the temp dir, only when something is fetched)")
    p.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")


def source_of(args: argparse.Namespace, package: str) -> Any:
    from kubetrt.pipeline.servable import ServableSource

    return ServableSource(package, args.store, args.engine_key, args.s3_endpoint)


def model_sources(args: argparse.Namespace) -> list[Any]:
    """One ModelSource per package. With both --model-name and --model-version nothing is fetched
    before the server binds (a fetch failure then shows as an unready model); otherwise the
    package is resolved now, for its name, and a failure is a start-up error."""
    from kubetrt.pipeline.servable import resolve_servable
    from kubetrt.serving.registry import Loadable, ModelSource

    if len(args.packages) > 1 and (args.engine_key or args.model_name or args.model_version):
        raise ValueError("--engine-key, --model-name and --model-version name one model; give exactly one PACKAGE with them")
    sources = []
    for package in args.packages:
        src = source_of(args, package)

        if args.model_name and args.model_version:
            sources.append(ModelSource(args.model_name, args.model_version, functools.partial(_resolve, src, args.cache_dir)))
            continue
        servable = resolve_servable(src, args.cache_dir)
        m = servable.manifest
        sources.append(ModelSource(args.model_name or m.name, args.model_version or m.version,
                                   functools.partial(_loadable, servable), m))
    return sources


def run(args: argparse.Namespace) -> int:
    from kubetrt.serving.batcher import BatcherConfig
    from kubetrt.serving.app import create_app
    from kubetrt.serving.registry import ServingConfig
    from kubetrt.serving.server import serve, uvicorn_config

    config = ServingConfig(
        device=args.device,
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
        grpc_port=None if args.no_grpc else args.grpc_port,
        grpc_host=args.host,
        graceful_timeout_s=args.graceful_timeout_s,
        shared_memory=args.shared_memory,
        idle_poll_us=args.idle_poll_us,
        trace_file=args.trace_file,
        trace_rate=args.trace_rate,
    )
    app = create_app(model_sources(args), config)
    return serve(uvicorn_config(app, args.host, args.port, verbose=args.verbose,
                                graceful_timeout_s=args.graceful_timeout_s))


def _resolve(source: Any, cache_dir: str | None) -> Any:
    """Resolved when the model loads: in the background, once the server is up."""
    from kubetrt.pipeline.servable import resolve_servable

    return _loadable(resolve_servable(source, cache_dir))


def _loadable(servable: Any) -> Any:
    from kubetrt.serving.registry import Loadable

    return Loadable(servable.package_dir, servable.engine_key, checked=True)
