"""Errors raised by pipeline stages.

All are ValueErrors: they describe bad input (a model, a path, an option), so the CLI reports
them as a one-line message instead of a traceback.
"""
from __future__ import annotations


class PipelineError(ValueError):
    """A pipeline stage refused its input; the message names what was wrong and what was expected."""


class IngestError(PipelineError):
    """A SavedModel directory is missing, malformed, or uses something the pipeline cannot lower."""


class LowerError(PipelineError):
    """Lowering a SavedModel to a model package failed or produced a graph that does not match TF."""
