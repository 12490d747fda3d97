"""The `kubetrt` command: the top of the flow, a thin dispatcher over pipeline, runtime and serving."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
