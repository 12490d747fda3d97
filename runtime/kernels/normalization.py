"""Per-instance and per-group normalization."""
from __future__ import annotations
