"""Subprocess entry for the allocator test: an app that reads each request's body and answers its
length, under the same `serve()` the CLI uses, with KUBETRT_MALLOC_TUNING set from argv[1] first."""
from __future__ import annotations

import os
import sys

from kubetrt.serving.server import serve, uvicorn_config
from serving_support import body_reader

if __name__ == "__main__":
    os.environ["KUBETRT_MALLOC_TUNING"] = sys.argv[1]
    sys.exit(serve(uvicorn_config(body_reader([], 0.0), "127.0.0.1", 0, verbose=1)))
