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

from . import capture
from .errors import KernelError
from .program import Program, Step


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


MAX_CAPTURED = 8  # input signatures a plan keeps a captured plan for; others run the generic one


class SequentialPlan:
    """Precompiled straight-line execution of a Program: the steps become one generated Python
    function whose values are local variables (`v12 = r3(v7, c0)[0]`, `del v7` where a value
    dies), so a step costs its kernel call and nothing else: no slot list, no loops over
    operands, no per-step exception frame. `steps` stays the plan's description; assigning new
    steps (a profiler wrapping each run) regenerates the function. The first call with an input
    signature is captured (capture.py): later calls with it run a plan whose runs of oneDNN
    steps are one chain each."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.steps: list[Step] = [
            (k.run, tuple(k.inputs), tuple(k.outputs), tuple(k.frees), k.id) for k in prog.kernels
        ]
        self.inputs = prog.inputs
        self.outputs = prog.outputs
        self._compiled: tuple[list[Step], Callable[..., list[np.ndarray]]] | None = None
        # per input signature: the captured steps (None: no chain formed) and the function generated from them
        self._captured: dict[tuple[Any, ...], tuple[list[Step] | None, Callable[..., list[np.ndarray]]]] = {}
        self._capturing = False  # whether calls are captured: set with the generated function

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        compiled = self._compiled
        if compiled is None or compiled[0] is not self.steps:
            compiled = self._compiled = (self.steps, _generate(self.prog, self.steps))
            self._captured = {}
            self._capturing = capture.ENABLED and capture.may_chain(self.steps)
        if len(feeds) != len(self.inputs):
            raise ValueError(f"expected {len(self.inputs)} inputs, got {len(feeds)}")
        if not self._capturing:
            return compiled[1](*feeds)
        try:
            signature = _signature(feeds)
        except AttributeError:  # not arrays: the kernels say what is wrong
            return compiled[1](*feeds)
        captured = self._captured.get(signature)
        if captured is not None:
            return captured[1](*feeds)
        if len(self._captured) >= MAX_CAPTURED:
            return compiled[1](*feeds)
        results, steps = capture.capture(self.prog, compiled[0], feeds, _failed_step)
        self._captured[signature] = (steps, compiled[1] if steps is None else _generate(self.prog, steps))
        return results

    def captured_steps(self, feeds: list[np.ndarray]) -> list[Step] | None:
        """The steps later calls with these feeds' signature run, once a call has captured them;
        None where no chain formed (or none was captured)."""
        captured = self._captured.get(_signature(feeds))
        return None if captured is None else captured[0]


def _signature(feeds: list[np.ndarray]) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """What a captured plan is kept for: the inputs' shapes and dtypes."""
    return tuple([(x.shape, x.dtype) for x in feeds])


def _generate(prog: Program, steps: list[Step]) -> Callable[..., list[np.ndarray]]:
    """The plan as one function of its inputs, in the order of `prog.inputs`."""
    scope: dict[str, Any] = {"_failed": _failed_step, "_prog": prog}
    consts = {v.id for v in prog.values if v.const is not None}

    def ref(vid: int) -> str:
        if vid < 0:
            return "None"
        if vid in consts:
            scope[f"c{vid}"] = prog.values[vid].const
            return f"c{vid}"
        return f"v{vid}"

    args = [f"v{vid}" for vid in prog.inputs]
    body = ["step = -1", "try:"]
    for i, (run, ins, outs, frees, kid) in enumerate(steps):
        scope[f"r{i}"] = run
        call = f"r{i}({', '.join(ref(v) for v in ins)})"
        body.append(f"    step = {kid}")
        targets = [f"v{v}" if v >= 0 else "_" for v in outs]
        body.append(f"    {targets[0]} = {call}[0]" if len(targets) == 1 else f"    {', '.join(targets)}, *_ = {call}")
        dead = [f"v{v}" for v in frees if v not in consts and v not in prog.inputs]
        if dead:
            body.append(f"    del {', '.join(dead)}")
    body.append(f"    return [{', '.join(ref(v) for v in prog.outputs)}]")
    body.append("except Exception as e:")
    body.append("    raise _failed(_prog, step, e) from e")
    source = f"def plan({', '.join(args)}):\n" + "\n".join("    " + line for line in body) + "\n"
    exec(compile(source, f"<kubetrt plan of {len(steps)} steps>", "exec"), scope)
    plan: Callable[..., list[np.ndarray]] = scope["plan"]
    return plan


def _failed_step(prog: Program, kid: int, e: BaseException) -> BaseException:
    return _kernel_error(prog, kid, e) if kid >= 0 else e


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
