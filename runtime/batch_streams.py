"""A batch split across the cores: each core runs its share of the samples by itself (a stream).

Why: a batch run layer by layer on the OpenMP team forks and joins the team per layer and streams
each layer's whole-batch activations through memory. A stream per core runs its samples through
the whole network on its own, a few at a time, so that their activations stay in that core's
cache. Whether that is faster depends on the model; it is timed per input signature
(StreamChoice), as a team's size is.

Only a graph whose samples never meet may be split: a softmax over the batch, a concatenation
along it or a reduction over it computes something else on a slice. So every kernel must keep
samples apart, by its op (SAMPLEWISE, or an axis that is not the batch's: AXIS_RULES) and by the
shapes it is traced with at two batch sizes: each computed operand's first dimension scales with
the batch and its other dimensions stay put. KUBETRT_BATCH_STREAMS: auto (the default, timed),
always (wherever a graph may be split; for tests), off.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from kubetrt.telemetry.logs import log

from . import capture
from .executor import SequentialPlan
from .kernels import omp, parallel
from .program import Kernel, Program
from .specialize import ShapeSpecializedPlan

STREAMS_ENV = "KUBETRT_BATCH_STREAMS"
MODES = ("auto", "always", "off")
logger = logging.getLogger("kubetrt.runtime")

# Kernels that compute each sample from that sample alone, whatever their attributes, given operands
# whose first dimension is the batch (the traced shapes check that).
SAMPLEWISE = frozenset("""
    Abs Add And AveragePool AveragePoolNHWC BatchNormalization Cast Ceil Clip Conv ConvTranspose Cos
    DenseChain DepthToSpace Div Dropout Elu Equal Erf Erfc Exp Expand Flatten Floor FromBlocked
    FusedAttention FusedConv FusedConvNHWC FusedMatMul Gelu Gemm GlobalAveragePool GlobalAveragePoolNHWC
    GlobalMaxPool GlobalMaxPoolNHWC Greater GreaterOrEqual GroupNormalization HardSigmoid HardSwish Identity
    InstanceNormalization LeakyRelu Less LessOrEqual Log MatMul Max MaxPool MaxPoolNHWC Mean Min Mod Mul
    MulAdd Neg Not Or Pow QConv QConvNHWC QMatMul Reciprocal Relu Reshape Resize Round Sigmoid Sign Silu
    Sin Softplus SpaceToDepth Sqrt Squeeze SqueezeExciteNHWC Sub Sum Tanh ToBlocked Unsqueeze Where Xor
""".split())

Consts = list[Any]  # a kernel's operands where constant, else None


def _axes(attrs: Mapping[str, Any], consts: Consts, rank: int, attr: str, default: Any, operand: int = -1) -> list[int] | None:
    """The axes a kernel works along (an attribute, or a constant operand in later opsets), made
    non-negative; None where they are not known here."""
    if attr in attrs:
        value = attrs[attr]
    elif 0 <= operand < len(consts) and consts[operand] is not None:
        value = consts[operand]
    elif default is None:
        return None
    else:
        value = default
    return [int(a) + rank if int(a) < 0 else int(a) for a in np.ravel(value)]


def _along(attr: str, default: Any, operand: int = -1) -> Callable[[Mapping[str, Any], Consts, int], bool]:
    """A kernel whose samples stay apart where none of its axes is the batch's."""
    return lambda attrs, consts, rank: 0 not in (_axes(attrs, consts, rank, attr, default, operand) or [0])


def _reduce(attrs: Mapping[str, Any], consts: Consts, rank: int) -> bool:
    axes = _axes(attrs, consts, rank, "axes", None, 1)
    return axes is not None and len(axes) > 0 and 0 not in axes  # no axes: all of them, the batch's too


def _transpose(attrs: Mapping[str, Any], consts: Consts, rank: int) -> bool:
    return "perm" in attrs and int(attrs["perm"][0]) == 0


def _slice(attrs: Mapping[str, Any], consts: Consts, rank: int) -> bool:
    if consts[1] is None:
        return False
    axes = _axes(attrs, consts, rank, "axes", list(range(np.size(consts[1]))), 3)
    return axes is not None and 0 not in axes


def _pad(attrs: Mapping[str, Any], consts: Consts, rank: int) -> bool:
    pads = consts[1] if len(consts) > 1 else None
    no_axes = len(consts) < 4 or consts[3] is None
    return pads is not None and no_axes and int(pads[0]) == 0 and int(pads[rank]) == 0


def _tile(attrs: Mapping[str, Any], consts: Consts, rank: int) -> bool:
    return consts[1] is not None and int(np.ravel(consts[1])[0]) == 1


# Kernels that keep samples apart for some attributes only: the batch's axis must not be one they work along.
AXIS_RULES: dict[str, Callable[[Mapping[str, Any], Consts, int], bool]] = {
    "Softmax": _along("axis", -1), "LogSoftmax": _along("axis", -1), "LayerNormalization": _along("axis", -1),
    "Concat": _along("axis", None), "Split": _along("axis", 0), "Gather": _along("axis", 0),
    "ArgMax": _along("axis", 0), "ArgMin": _along("axis", 0), "TopK": _along("axis", -1),
    "CumSum": _along("", None, 1), "Transpose": _transpose, "Slice": _slice, "Pad": _pad, "Tile": _tile,
    **{op: _reduce for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                              "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare")},
}


def _keeps_apart(kernel: Kernel, consts: Consts, rank: int) -> bool:
    if kernel.op in SAMPLEWISE:
        return True
    rule = AXIS_RULES.get(kernel.op)
    return rule is not None and rule(kernel.attrs, consts, rank)


Meta = tuple[tuple[int, ...], np.dtype] | None


def mixing_kernel(prog: Program, kids: list[int], metas: list[list[Meta]], small: list[list[Meta]], n: int, c: int) -> str | None:
    """Where a program traced with a batch of `n` (`metas`, per step its operands' shapes) and of `c`
    (`small`) lets samples meet: the first kernel that may, said; None where none does."""
    if len(metas) != len(small):
        return f"the plan differs between batch sizes {n} and {c}"
    for kid, at_n, at_c in zip(kids, metas, small):
        kernel = prog.kernels[kid]
        consts = [None if v < 0 else prog.values[v].const for v in kernel.inputs]
        rank = 0
        for vid, a, b in zip(kernel.inputs, at_n, at_c):
            if vid < 0 or prog.values[vid].const is not None:
                continue
            if a is None or b is None or not a[0] or a[0][1:] != b[0][1:] or a[0][0] * c != b[0][0] * n:
                return f"{kernel.op} {kernel.name}: an operand whose first dimension is not the batch's"
            rank = rank or len(a[0])
        if not _keeps_apart(kernel, consts, rank):
            return f"{kernel.op} {kernel.name}: it may combine samples"
    return None


def streams_mode(env: Mapping[str, str]) -> str:
    value = env.get(STREAMS_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{STREAMS_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def cache_bytes() -> int:
    """A core's own cache (L2), what a stream's activations should fit in; 1 MiB where it is not known."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip().upper()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        return 1 << 20


def piece_size(share: int, sample_bytes: int, budget: int) -> int:
    """Samples per call of a stream: the most that divide its share and keep the largest
    activation within `budget`, at least one."""
    fits = max(1, budget // max(sample_bytes, 1))
    return max(d for d in range(1, share + 1) if share % d == 0 and d <= fits)


class StreamChoice(omp.TeamChoice):
    """Per input signature: the whole batch on the team, or streams, whichever has been faster lately
    (`pick` says whether to stream). The two take turns for the first TRIALS calls each, so that
    neither is judged on one call; then streams must win by a few percent, and a slower call (an
    inner kernel timing its team of one, a page fault) raises a way's time by ALPHA * RISE at most:
    a choice made on noise costs a stream's cache, or the team's speed, for EXPLORE calls.

    A batch's calls are long and few, so the trials may all fall in a passing load (a server's
    event loop parsing large requests on one of the cores) and judge the ways by it. So once calls
    have run one way for EXPLORE_SECONDS, one call runs the other: one that wins takes the choice
    back at once (a faster call counts at once); each exploration lost doubles the wait, up to
    MAX_EXPLORE_SECONDS, and one won starts it over. Only a short batch whose streams were far
    slower after the trials is left whole for good (hopeless): there timing the choice costs a
    call a microsecond, and a lost exploration a visible share of the call."""

    MARGIN = 0.97
    RISE = 0.1
    # the first call traced the plan and warmed the streams; the second makes the whole batch's chains
    WARM = 2
    TRIALS = 2
    HOPELESS = 1.5  # streams this much slower than the whole batch after the trials: the signature stays whole...
    HOPELESS_SECONDS = 1e-3  # ...where the whole batch takes less than this; a longer one is explored over time
    EXPLORE_SECONDS, MAX_EXPLORE_SECONDS = 1.0, 16.0
    ENABLED = omp.TeamChoice.CAPABLE

    def __init__(self) -> None:
        super().__init__(keeps_apart=False)
        self.spent = 0.0  # seconds of calls run the way pick takes since the other way last ran
        self.explore_after = self.EXPLORE_SECONDS
        self.exploring = False  # this call runs the other way, to see whether it has become the faster

    def hopeless(self) -> bool:
        """Whether the trials found streams slower than a short whole batch by far: not worth timing again."""
        whole, streams = self.mean
        return (self.calls >= self.WARM + 2 * self.TRIALS and whole is not None and streams is not None
                and whole < self.HOPELESS_SECONDS and streams > self.HOPELESS * whole)

    def pick(self) -> bool:
        trial = self.calls - self.WARM
        self.exploring = False
        if self.ENABLED and trial < 2 * self.TRIALS:
            self.calls += 1
            return trial >= 0 and trial % 2 == 1
        streamed = super().pick()
        if self.ENABLED and self.spent >= self.explore_after:
            self.spent, self.exploring = 0.0, True
            return not streamed
        return streamed

    def _update(self, serial: bool, seconds: float) -> None:
        super()._update(serial, seconds)
        if not self.exploring:
            if self.calls > self.WARM + 2 * self.TRIALS:  # the trials ran both ways: the wait starts after them
                self.spent += seconds
            return
        won = self.alone_faster() == serial  # the way explored is the one pick takes now
        self.explore_after = self.EXPLORE_SECONDS if won else min(2 * self.explore_after, self.MAX_EXPLORE_SECONDS)


@dataclass
class Split:
    """How a batch of one signature runs as streams: pieces of `piece` samples, `streams` of them at once."""

    batch: int
    piece: int
    streams: int
    choice: StreamChoice


UNSEEN = Split(0, 0, 0, StreamChoice())  # a signature not yet called with
MAX_SIGNATURES = 16  # signatures decided per plan; later ones stay whole


class BatchStreams:
    """A host plan whose batches run as streams where that is allowed and faster (module docstring)."""

    def __init__(self, plan: SequentialPlan | ShapeSpecializedPlan, streams: int = omp.TEAM,
                 mode: str | None = None, budget: int | None = None) -> None:
        self.plan = plan
        self.streams = streams
        self.mode = streams_mode(os.environ) if mode is None else mode
        self.budget = cache_bytes() // 2 if budget is None else budget
        self.active = self.mode != "off" and streams > 1
        self.min_batch = 2 * streams  # a stream's share is a sample at least, and smaller batches gain nothing
        self._splits: dict[tuple[Any, ...], Split | None] = {}  # per input signature: None where it stays whole

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        try:
            if not self.active or feeds[0].shape[0] < self.min_batch or parallel.alone():  # alone: on one thread as a whole
                return self.plan.run(feeds)
            key = tuple([x.shape for x in feeds])
        except (AttributeError, IndexError):  # not arrays, or scalars: the plan says what is wrong
            return self.plan.run(feeds)
        split = self._splits.get(key, UNSEEN)
        if split is None:
            return self.plan.run(feeds)
        if split is UNSEEN:
            return self._first(key, feeds)
        if self.mode == "always":
            return self.streamed(split, feeds)
        choice = split.choice
        streamed = choice.pick()
        start = time.perf_counter()
        results = self.streamed(split, feeds) if streamed else self.plan.run(feeds)
        choice.record(streamed, time.perf_counter() - start)
        if streamed and choice.hopeless():
            self._splits[key] = None
        return results

    def streaming(self, feeds: list[np.ndarray]) -> Split | None:
        """How batches like `feeds` run now: their Split where they run as streams (the choice
        timed so far prefers them, or the mode says always), None where they run whole."""
        split = self._splits.get(tuple(np.shape(x) for x in feeds))
        if split is None or split is UNSEEN:
            return None
        return split if self.mode == "always" or split.choice.alone_faster() else None

    def streamed(self, split: Split, feeds: list[np.ndarray]) -> list[np.ndarray]:
        """The plan's results for `feeds`, computed by `split.streams` streams of pieces."""
        pieces = split.batch // split.piece
        parts: list[list[np.ndarray] | None] = [None] * pieces
        size = split.piece

        def run_pieces(lo: int, hi: int) -> None:
            with omp.Alone():
                for p in range(lo, hi):
                    parts[p] = self.plan.run([x[p * size:(p + 1) * size] for x in feeds])

        parallel.split_range(run_pieces, pieces, split.streams)
        return [np.concatenate(outs) for outs in zip(*parts)]

    def _first(self, key: tuple[Any, ...], feeds: list[np.ndarray]) -> list[np.ndarray]:
        """The first call with a signature (run() saw its first input's batch): its results, and
        whether (and how) later ones split."""
        if len(self._splits) >= MAX_SIGNATURES:
            return self.plan.run(feeds)
        n = feeds[0].shape[0]
        if n % self.streams or any(x.ndim == 0 or x.shape[0] != n for x in feeds):
            self._splits[key] = None
            return self.plan.run(feeds)
        try:
            plan_n, results, metas_n = self._traced(feeds)
        except Exception:  # noqa: BLE001 - the plan itself says what is wrong with these inputs
            self._splits[key] = None
            return self.plan.run(feeds)
        self._splits[key] = self._split_for(feeds, plan_n, results, metas_n)
        return results

    def _split_for(self, feeds: list[np.ndarray], plan_n: SequentialPlan, results: list[Any], metas_n: list[list[Meta]]) -> Split | None:
        """How batches like `feeds` split, traced as `metas_n`; None where they may not."""
        n = feeds[0].shape[0]
        share = n // self.streams
        sample_bytes = max((int(np.prod(m[0])) * m[1].itemsize for ms in metas_n for m in ms if m is not None), default=0) // n
        piece = piece_size(share, sample_bytes, self.budget)
        try:
            plan_c, _, metas_c = self._traced([x[:piece] for x in feeds])
        except Exception as e:  # noqa: BLE001 - a slice the plan cannot run is a batch that may not split
            log(logger, logging.DEBUG, "batch streams: the plan does not run on a slice", error=f"{type(e).__name__}: {e}")
            return None
        ops_n = [plan_n.prog.kernels[kid].op for *_, kid in plan_n.steps]
        ops_c = [plan_c.prog.kernels[kid].op for *_, kid in plan_c.steps]
        reason = ("an output without the batch" if any(not isinstance(o, np.ndarray) or o.ndim == 0 or o.shape[0] != n for o in results)
                  else f"the plan differs between batch sizes {n} and {piece}" if ops_n != ops_c
                  else mixing_kernel(plan_n.prog, [kid for *_, kid in plan_n.steps], metas_n, metas_c, n, piece))
        if reason is not None:
            log(logger, logging.DEBUG, "batch streams: the batch stays whole", reason=reason)
            return None
        split = Split(n, piece, self.streams, StreamChoice())
        self.streamed(split, feeds)  # its first call makes each piece's chains and primitives: not one to time
        return split

    def _traced(self, feeds: list[np.ndarray]) -> tuple[SequentialPlan, list[Any], list[list[Meta]]]:
        plan = self.plan.specialized(feeds) if isinstance(self.plan, ShapeSpecializedPlan) else self.plan
        if not isinstance(plan, SequentialPlan):
            raise TypeError(f"a {type(plan).__name__} is not traced")
        results, _, metas = capture.trace(plan.prog, plan.steps, feeds, lambda _prog, _kid, e: e)
        return plan, results, metas


def streamed(exe: Any) -> Any:
    """`exe` with its batches run as streams where it is a host plan that may gain from them."""
    if isinstance(exe, (SequentialPlan, ShapeSpecializedPlan)) and omp.TEAM > 1:
        return BatchStreams(exe)
    return exe
