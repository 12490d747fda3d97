"""`kubetrt devices`: which device runtimes this node can run, and why not where it cannot."""
from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("devices", help="list device runtimes (host, cuda, tensorrt) and whether this node can run them")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=run)


def describe() -> list[dict[str, object]]:
    """One row per device runtime, in `--device auto` preference order."""
    from kubetrt.runtime.devices import available_devices, get_device

    rows = []
    for name, reason in available_devices().items():
        row: dict[str, object] = {"device": name, "available": reason is None, "reason": reason}
        if reason is None:
            ident = get_device(name).identity()
            row.update(gpu_product=ident.gpu_product, compute_capability=ident.compute_capability,
                       backend_version=ident.backend_version)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        if row["available"]:
            cc = f", compute capability {row['compute_capability']}" if row["compute_capability"] else ""
            print(f"{row['device']}: available ({row['gpu_product']}{cc}, {row['backend_version']})")
        else:
            print(f"{row['device']}: unavailable: {row['reason']}")
    auto = next(r["device"] for r in rows if r["available"])
    print(f"--device auto -> {auto}")
    return 0
