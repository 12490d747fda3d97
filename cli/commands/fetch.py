"""`kubetrt fetch PACKAGE --store URI --engine-key KEY`: the servable source on its own.

Resolves what a serving pod would serve into the cache directory and prints the local package
path, so an init container, a debugging session or a script gets exactly what `serve` loads.
"""
from __future__ import annotations

import argparse

from kubetrt.cli.commands.serve import add_source_arguments, source_of


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("fetch", help="fetch a model package with its verified engine into a local cache")
    p.add_argument("package", metavar="PACKAGE", help="model package: directory, file:// or s3:// URI")
    add_source_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kubetrt.pipeline.servable import resolve_servable

    servable = resolve_servable(source_of(args, args.package), args.cache_dir)
    print(servable.package_dir)
    return 0
