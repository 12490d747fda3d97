"""kubetrt: TensorFlow SavedModel to verified per-GPU engines, served on Kubernetes.

A thin dispatcher: each subcommand lives in cli/commands/.

Subcommand modules only declare arguments at import time and import their heavy dependencies
(TensorFlow, kfp, uvicorn) inside the handler, so `kubetrt --help` stays instant.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = ("lower", "build", "fetch", "serve", "traces", "pipeline", "demo", "devices")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the help already names one or there is
    nothing to show (None, False, empty): one place, so `--help` always says what an unset flag does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is argparse.SUPPRESS or default is None or default is False
                or default in ((), [], "") or not action.option_strings):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})".lstrip()


class CommandParser(argparse.ArgumentParser):
    """Subcommand parsers (and theirs) format their help with DefaultsHelpFormatter."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubetrt", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"kubetrt.cli.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"kubetrt.cli.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kubetrt.telemetry.logs import configure

    configure(verbosity=args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        logging.getLogger("kubetrt").debug("command failed", exc_info=True)
        print(f"kubetrt {args.command}: error: {e}", file=sys.stderr)
        return 2

