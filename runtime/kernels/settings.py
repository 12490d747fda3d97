"""The runtime's on/off settings, read one way: 1 (the default, also where unset or empty) or 0,
and anything else an error that names the variable and what it switches."""
from __future__ import annotations

from typing import Mapping


def switched_on(env: Mapping[str, str], name: str, what: str) -> bool:
    """Whether the setting `name` (which turns on `what`) is 1 rather than 0."""
    text = env.get(name, "1").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: expected 1 ({what}) or 0")
    return text == "1"
