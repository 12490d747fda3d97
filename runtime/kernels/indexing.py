"""Gather/scatter-style indexing, cumulative sums, one-hot, triangles, sequence reversal and non-max suppression."""
from __future__ import annotations
