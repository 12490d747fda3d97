"""Transposed convolution."""
from __future__ import annotations
