"""Control flow (If, Loop, Scan): sub-graphs compiled once and run on the same executor."""
from __future__ import annotations
