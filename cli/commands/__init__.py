"""Subcommands of the kubetrt CLI; each module defines register(subparsers)."""
