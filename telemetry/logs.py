"""Structured, quiet-by-default logging: key=value lines on stderr, warnings only unless -v."""
from __future__ import annotations

import logging
import sys
from typing import Any


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {}) or {}
        parts = [f"level={record.levelname.lower()}", f"logger={record.name}", f"msg={record.getMessage()!r}"]
        parts += [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items()]
        if record.exc_info:
            parts.append(f"exc={self.formatException(record.exc_info)!r}")
        return " ".join(parts)


def configure(verbosity: int = 0) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    root = logging.getLogger("kubetrt")
    root.setLevel(level)
    if not any(getattr(h, "_kubetrt", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(KeyValueFormatter())
        handler._kubetrt = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.propagate = False


def log(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """logger.log with structured fields rendered as key=value."""
    logger.log(level, msg, extra={"fields": fields})
