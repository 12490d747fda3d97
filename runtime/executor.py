"""Executors for a Program.

- `SequentialPlan`: the fast path. Kernels are pre-resolved into a flat list of (run, operand
  slots, result slots, slots to free); one Python loop, no locks, no futures.
- `DataflowExecutor`: TFRT-style. Each run gets ready counts; a kernel is submitted to the thread
  pool the moment its last operand becomes available; independent kernels run concurrently
  (NumPy releases the GIL in BLAS and ufuncs). A failing kernel turns its outputs into error
  values, which flow to dependents instead of running them, and surface at the outputs.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .errors import KernelError
from .program import Program


class AsyncValue:
    """A value that will be available later, or an error; callbacks fire once it is set."""

    __slots__ = ("_state", "_value", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._state = 0  # 0 pending, 1 available, 2 error
        self._value: Any = None
        self._callbacks: list[Callable[["AsyncValue"], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def ready(cls, value: Any) -> "AsyncValue":
        av = cls()
        av._state, av._value = 1, value
        return av

    @property
    def is_error(self) -> bool:
        return self._state == 2

    @property
    def value(self) -> Any:
        return self._value

    def _set(self, state: int, value: Any) -> None:
        with self._lock:
            if self._state:
                raise RuntimeError("AsyncValue set twice")
            self._state, self._value = state, value
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def set_value(self, value: Any) -> None:
        self._set(1, value)

    def set_error(self, error: BaseException) -> None:
        self._set(2, error)

    def and_then(self, cb: Callable[["AsyncValue"], None]) -> None:
        with self._lock:
            if not self._state:
                self._callbacks.append(cb)
                return
        cb(self)


def _kernel_error(prog: Program, kid: int, e: BaseException) -> KernelError:
    k = prog.kernels[kid]
    err = KernelError(f"kernel {k.op} (node {k.name}) failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


class SequentialPlan:
    """Precompiled straight-line execution of a Program."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.n_slots = len(prog.values)
        self.template: list[Any] = [v.const for v in prog.values]
        self.steps = [
            (k.run, tuple(k.inputs), tuple(k.outputs), tuple(k.frees), k.id) for k in prog.kernels
        ]
        self.inputs = prog.inputs
        self.outputs = prog.outputs

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        slots = list(self.template)
        for vid, x in zip(self.inputs, feeds):
            slots[vid] = x
        for run, ins, outs, frees, kid in self.steps:
            try:
                results = run(*[slots[i] if i >= 0 else None for i in ins])
            except Exception as e:
                raise _kernel_error(self.prog, kid, e) from e
            for vid, r in zip(outs, results):
                if vid >= 0:
                    slots[vid] = r
            for vid in frees:
                slots[vid] = None
        return [slots[i] for i in self.outputs]


class DataflowExecutor:
    """Runs independent kernels concurrently on a thread pool, driven by ready counts."""

    def __init__(self, prog: Program, pool: ThreadPoolExecutor) -> None:
        self.prog = prog
        self.pool = pool
        self.operand_counts = [k.operand_count for k in prog.kernels]
        # consumers of each value, with multiplicity, so ready counts fall to exactly zero
        self.consumers: list[list[int]] = [[] for _ in prog.values]
        for k in prog.kernels:
            for vid in k.inputs:
                if vid >= 0 and prog.values[vid].const is None:
                    self.consumers[vid].append(k.id)

    def run_async(self, feeds: list[np.ndarray]) -> Future:
        prog = self.prog
        values: list[AsyncValue | None] = [AsyncValue.ready(v.const) if v.const is not None else None for v in prog.values]
        for vid in prog.inputs:
            values[vid] = AsyncValue()
        for k in prog.kernels:
            for vid in k.outputs:
                if vid >= 0:
                    values[vid] = AsyncValue()
        ready = list(self.operand_counts)
        lock = threading.Lock()
        done: Future = Future()

        def fire(kid: int) -> None:
            k = prog.kernels[kid]
            args = [values[i] if i >= 0 else None for i in k.inputs]
            err = next((a.value for a in args if a is not None and a.is_error), None)
            if err is not None:
                for vid in k.outputs:
                    if vid >= 0:
                        values[vid].set_error(err)  # type: ignore[union-attr]
                return
            try:
                results = k.run(*[a.value if a is not None else None for a in args])
            except Exception as e:
                wrapped = _kernel_error(prog, kid, e)
                for vid in k.outputs:
                    if vid >= 0:
                        values[vid].set_error(wrapped)  # type: ignore[union-attr]
                return
            for vid, r in zip(k.outputs, results):
                if vid >= 0:
                    values[vid].set_value(r)  # type: ignore[union-attr]

        def on_available(vid: int) -> Callable[[AsyncValue], None]:
            def cb(_: AsyncValue) -> None:
                launch = []
                with lock:
                    for kid in self.consumers[vid]:
                        ready[kid] -= 1
                        if ready[kid] == 0:
                            launch.append(kid)
                for kid in launch:
                    self.pool.submit(fire, kid)

            return cb

        for vid, av in enumerate(values):
            if av is not None and prog.values[vid].const is None and self.consumers[vid]:
                av.and_then(on_available(vid))

        remaining = [len(prog.outputs)]

        def output_done(_: AsyncValue) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                outs = [values[i] for i in prog.outputs]
                err = next((o.value for o in outs if o.is_error), None)  # type: ignore[union-attr]
                if err is not None:
                    done.set_exception(err)
                else:
                    done.set_result([o.value for o in outs])  # type: ignore[union-attr]

        for vid in prog.outputs:
            values[vid].and_then(output_done)  # type: ignore[union-attr]
        for kid, k in enumerate(prog.kernels):  # kernels with only constant operands
            if self.operand_counts[kid] == 0:
                self.pool.submit(fire, kid)
        for vid, x in zip(prog.inputs, feeds):
            values[vid].set_value(x)  # type: ignore[union-attr]
        return done

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        return self.run_async(feeds).result()
