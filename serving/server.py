"""Run the app under uvicorn with graceful shutdown.

On SIGTERM/SIGINT uvicorn stops accepting, lets in-flight requests finish (up to
`graceful_timeout_s`), then runs the app's shutdown (batchers drain and stop). uvicorn re-raises
the captured signal once it is done, which would turn a clean drain into death-by-signal; we keep
a no-op handler installed so the process exits 0, as Kubernetes expects from a drained pod.

A server's requests and answers of megabytes (a tensor's body, its pieces, a gRPC message) are
fresh allocations every time: the allocator is tuned as the host runtime tunes it
(runtime/memory.py), whatever the device, so they reuse freed memory instead of new mappings
faulted in a page at a time.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

import uvicorn

from kubetrt.runtime.memory import keep_freed_memory

from .http_protocol import ServingHttpProtocol


def uvicorn_config(app: Any, host: str, port: int, *, verbose: int = 0, graceful_timeout_s: float = 30.0,
                   **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info" if verbose > 0 else "warning",
        access_log=verbose > 1,
        timeout_graceful_shutdown=int(graceful_timeout_s),
        lifespan="on",
        **{"http": ServingHttpProtocol, **kwargs},
    )


def serve(config: uvicorn.Config) -> int:
    """Blocking; returns the process exit code (0 after a graceful, signal-initiated shutdown)."""
    keep_freed_memory()
    server = uvicorn.Server(config)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
    server.run()
    return 0 if server.started else 1
