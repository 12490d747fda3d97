"""Plans compiled for the input shapes a model is actually called with.

A graph with dynamic dimensions (the batch, a sequence length) often computes shapes at run time:
converters emit Shape -> Gather -> Concat -> Reshape chains that the generic plan runs on every
call, a few microseconds each, dozens per layer of a transformer. Compiled again with the
concrete input shapes, the optimizer folds those chains to constants and they vanish from the
plan. The first call with a new input signature runs the generic plan while the specialized one
compiles on the runtime's pool; later calls with that signature run it. Only graphs whose plan
still contains shape work are specialized, and only a few signatures are kept (each holds its own
copy of the weights).
"""
from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import Future
from typing import Callable

import numpy as np

from kubetrt.telemetry.logs import log

from .graph import Graph
from .kernels.parallel import shared_pool
from .program import Plan, Program

SHAPE_OPS = frozenset({"Shape", "Size"})
MAX_SIGNATURES = 4  # specialized plans kept per model; the oldest is dropped for a new one
logger = logging.getLogger("kubetrt.runtime")

Signature = tuple[tuple[int, ...], ...]


def computes_shapes(prog: Program) -> bool:
    """Whether the plan reads tensor shapes at run time: what specializing would fold away."""
    return any(k.op in SHAPE_OPS for k in prog.kernels)


def with_input_shapes(graph: Graph, shapes: Signature) -> Graph:
    """A copy of `graph` whose inputs have these concrete shapes."""
    concrete = copy.deepcopy(graph)
    for value, shape in zip(concrete.inputs, shapes):
        value.shape = tuple(shape)
    return concrete


class ShapeSpecializedPlan:
    """The generic plan, plus a plan per input signature compiled in the background."""

    def __init__(self, graph: Graph, generic: Plan, compile_plan: Callable[[Graph], Plan],
                 max_signatures: int = MAX_SIGNATURES) -> None:
        self.graph = graph  # as loaded, never optimized itself: each specialization copies it
        self.generic = generic
        self.compile_plan = compile_plan
        self.max_signatures = max_signatures
        self.plans: dict[Signature, Plan] = {}
        self.pending: dict[Signature, Future] = {}
        self.failed: set[Signature] = set()
        self._lock = threading.Lock()

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        signature = tuple(np.shape(x) for x in feeds)
        plan = self.plans.get(signature)
        if plan is not None:
            return plan.run(feeds)
        self._specialize(signature)
        return self.generic.run(feeds)

    def specialized(self, feeds: list[np.ndarray]) -> Plan:
        """The plan for these inputs' shapes, compiled now if it is not yet (tests, warm-up)."""
        signature = tuple(np.shape(x) for x in feeds)
        self._specialize(signature)
        future = self.pending.get(signature)
        if future is not None:
            future.exception()  # waits; a failure leaves the generic plan in charge
        return self.plans.get(signature, self.generic)

    def _specialize(self, signature: Signature) -> None:
        with self._lock:
            if signature in self.plans or signature in self.pending or signature in self.failed:
                return
            self.pending[signature] = shared_pool().submit(self._compile, signature, with_input_shapes(self.graph, signature))

    def _compile(self, signature: Signature, graph: Graph) -> Plan:
        try:
            plan = self.compile_plan(graph)
        except Exception as e:
            with self._lock:
                self.pending.pop(signature, None)
                self.failed.add(signature)
            log(logger, logging.WARNING, "shape specialization failed; the generic plan serves these shapes",
                shapes=str(signature), error=f"{type(e).__name__}: {e}")
            raise
        with self._lock:
            while len(self.plans) >= self.max_signatures:
                self.plans.pop(next(iter(self.plans)))
            self.plans[signature] = plan
            self.pending.pop(signature, None)
        return plan
