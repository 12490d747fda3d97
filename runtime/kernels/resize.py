"""Resizing and depth/space rearrangement of images."""
from __future__ import annotations
