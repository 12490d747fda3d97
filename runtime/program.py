"""Program: an optimized graph lowered to TFRT-style values and kernels.

Values are registers with use counts; kernels carry operand counts and `used_by` lists so the
dataflow executor can fire a kernel the moment its last operand arrives. Memory planning decides,
from liveness, when each value is freed and which kernels may overwrite a dying operand.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .errors import UnsupportedOpError
from .graph import CAPTURES, Graph, Node
from .kernels.registry import Run, Shape, lookup
from .kernels.tensor import concat_grows_into_operand
from .passes import optimize
from .passes.shape_inference import spec_for

# Kernels whose output may share memory with input 0: writing into one would corrupt the other.
VIEW_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Slice", "Split", "Cast",
            "Transpose", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "Expand",
            "ToBlocked", "FromBlocked"}  # the layout changes hand small batches through
# Kernels that honour `inplace` for these operand positions.
INPLACE_OPERANDS = {
    "Relu": (0,), "Sigmoid": (0,), "Tanh": (0,), "HardSwish": (0,), "HardSigmoid": (0,), "Gelu": (0,),
    "Exp": (0,), "Log": (0,), "Sqrt": (0,), "Neg": (0,), "Abs": (0,), "Reciprocal": (0,), "Erf": (0,),
    "Clip": (0,), "Softmax": (0,), "LogSoftmax": (0,),
    "Add": (0, 1), "Sub": (0, 1), "Mul": (0, 1), "Div": (0, 1),
    "FusedConv": (3,), "FusedConvNHWC": (3,), "FusedMatMul": (3,), "QConv": (3,), "QConvNHWC": (3,), "QMatMul": (3,),
    "SqueezeExciteNHWC": (0,),
}


@dataclass
class Value:
    id: int
    name: str
    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    const: np.ndarray | None = None
    producer: int | None = None  # kernel id; None for inputs and constants
    use_count: int = 0


@dataclass
class Kernel:
    id: int
    op: str
    name: str
    inputs: list[int]  # value ids; -1 = omitted optional operand
    outputs: list[int]
    run: Run
    operand_count: int = 0  # non-constant operands to wait for
    used_by: list[int] = field(default_factory=list)  # kernel ids consuming any output
    frees: list[int] = field(default_factory=list)  # value ids dead after this kernel
    inplace: frozenset[int] = frozenset()
    attrs: dict[str, Any] = field(default_factory=dict)  # the node's, as optimized: what a kernel's axes are


@dataclass
class Program:
    values: list[Value]
    kernels: list[Kernel]
    inputs: list[int]
    outputs: list[int]
    device: str = "host"
    stats: dict[str, Any] = field(default_factory=dict)
    alias_root: dict[int, int] = field(default_factory=dict)  # kernel output -> value whose memory it may share

    def value(self, name: str) -> Value:
        return next(v for v in self.values if v.name == name)

    def describe(self) -> str:
        ops: dict[str, int] = {}
        for k in self.kernels:
            ops[k.op] = ops.get(k.op, 0) + 1
        return ", ".join(f"{op}x{n}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1]))

    def borrowed_outputs(self) -> tuple[bool, ...]:
        """Per output: may it be memory the program does not own for its caller (an input, a
        constant, or the same memory as an earlier output)? A caller that hands it on must copy it."""
        seen: set[int] = set()
        borrowed = []
        for vid in self.outputs:
            root = self.alias_root.get(vid, vid)
            borrowed.append(root in self.inputs or self.values[root].const is not None or root in seen)
            seen.add(root)
        return tuple(borrowed)


# A plan's step: the kernel's run, its operand and result value ids, the values dead after it, its kernel id.
Step = tuple[Callable[..., Any], tuple[int, ...], tuple[int, ...], tuple[int, ...], int]


class Plan(Protocol):
    """An executor of a compiled Program (executor.SequentialPlan)."""

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]: ...


# Builds the executor a sub-graph runs on. A parameter, not an import: executor.py imports this
# module, so the device runtime (which imports both) hands its SequentialPlan in.
Planner = Callable[[Program], Plan]


@dataclass
class CompiledSubgraph:
    """A GRAPH attribute lowered once; control-flow kernels call `run` per branch taken or iteration."""

    run: Callable[[list[np.ndarray]], list[np.ndarray]]
    inputs: list[tuple[Shape, np.dtype | None]]
    outputs: list[tuple[Shape, np.dtype | None]]
    borrowed: tuple[bool, ...]  # outputs a kernel must copy before returning them (Program.borrowed_outputs)


def compile_graph(graph: Graph, device: str = "host", fusion: bool = True, concurrent: bool = False, layout: bool = True,
                  subgraph_plan: Planner | None = None) -> Program:
    """Optimize `graph` and lower it to a Program of kernels for `device`.

    `concurrent=True` plans memory for the dataflow executor, where "last in program order" is
    not "last to run": a kernel may then overwrite only operands nobody else reads.
    Sub-graphs (If, Loop, Scan) are optimized and lowered the same way, once, and run on the
    executor `subgraph_plan` builds; a graph with sub-graphs needs it.
    """
    nodes_before = len(graph.nodes)
    _check_supported(graph, device)
    optimize(graph, fusion=fusion, layout=layout)
    _inline_constant_captures(graph)

    ids: dict[str, int] = {}
    values: list[Value] = []

    def new_value(name: str, const: np.ndarray | None = None) -> int:
        info = graph.values.get(name)
        v = Value(len(values), name, info.dtype if info else None, info.shape if info else None, const)
        values.append(v)
        ids[name] = v.id
        return v.id

    for i in graph.inputs:
        new_value(i.name)
    for name, c in graph.constants.items():
        new_value(name, c)

    alias_root: dict[int, int] = {}
    kernels: list[Kernel] = []
    for node in graph.nodes:
        ins = []
        for name in node.inputs:
            if not name:
                ins.append(-1)
                continue
            if name not in ids:
                raise UnsupportedOpError(f"node {node.name} ({node.op}): input {name!r} is not produced by any node")
            ins.append(ids[name])
        outs = [new_value(o) if o else -1 for o in node.outputs]
        k = Kernel(len(kernels), node.op, node.name, ins, outs, run=_noop, attrs=node.attrs)
        for vid in ins:
            if vid >= 0:
                values[vid].use_count += 1
        for vid in outs:
            if vid >= 0:
                values[vid].producer = k.id
                shares = node.op in VIEW_OPS or concat_grows_into_operand(node.op, node.attrs)
                alias_root[vid] = alias_root.get(ins[0], ins[0]) if shares and ins and ins[0] >= 0 else vid
        k.operand_count = sum(1 for vid in ins if vid >= 0 and values[vid].const is None)
        kernels.append(k)
    for k in kernels:
        for vid in k.inputs:
            p = values[vid].producer if vid >= 0 else None
            if p is not None and k.id not in kernels[p].used_by:
                kernels[p].used_by.append(k.id)

    outputs = [ids[o.name] for o in graph.outputs]
    _plan_memory(kernels, values, alias_root, set(ids[i.name] for i in graph.inputs), set(outputs), concurrent)

    node_by_name = {n.name: n for n in graph.nodes}
    for k in kernels:
        node = node_by_name[k.name]
        spec = spec_for(graph, node, inplace=k.inplace)
        spec.subgraphs = {key: _compile_subgraph(node, key, sub, device, fusion, layout, subgraph_plan)
                          for key, sub in node.subgraphs().items()}
        k.run = lookup(k.op, device, node=k.name).factory(spec)

    prog = Program(values, kernels, [ids[i.name] for i in graph.inputs], outputs, device=device, alias_root=alias_root)
    prog.stats = {"nodes_in": nodes_before, "kernels": len(kernels), "constants": len(graph.constants),
                  "inplace_kernels": sum(1 for k in kernels if k.inplace)}
    return prog


def _noop(*_: Any) -> tuple[np.ndarray, ...]:
    raise AssertionError("kernel not compiled")


def _check_supported(graph: Graph, device: str) -> None:
    for node in graph.nodes:
        lookup(node.op, device, node=node.name)  # raises UnsupportedOpError naming op, node and the supported list
        for sub in node.subgraphs().values():
            _check_supported(sub, device)


def _compile_subgraph(node: Node, key: str, sub: Graph, device: str, fusion: bool, layout: bool,
                      planner: Planner | None) -> CompiledSubgraph:
    if planner is None:
        raise UnsupportedOpError(f"node {node.name} ({node.op}): sub-graph {key} needs an executor to run on; "
                                 "compile through a device runtime (compile_graph(..., subgraph_plan=...))")
    prog = compile_graph(sub, device, fusion=fusion, layout=layout, subgraph_plan=planner)

    def types(names: list[str]) -> list[tuple[Shape, np.dtype | None]]:
        return [(v.shape, v.dtype) if (v := sub.values.get(n)) is not None else (None, None) for n in names]

    return CompiledSubgraph(planner(prog).run, types([v.name for v in sub.inputs]), types([v.name for v in sub.outputs]),
                            prog.borrowed_outputs())


def _inline_constant_captures(graph: Graph) -> None:
    """Captured outer constants become constants of the sub-graphs (which can then fold and fuse
    them, as weights of a loop body) instead of operands passed on every run."""
    for node in graph.nodes:
        k, subs = node.captures, node.subgraphs()
        own = len(node.inputs) - k
        consts = {j for j, x in enumerate(node.inputs[own:]) if x in graph.constants}
        if not consts:
            continue
        for sub in subs.values():
            base = len(sub.inputs) - k
            for j in consts:
                sub.constants[sub.inputs[base + j].name] = graph.constants[node.inputs[own + j]]
            sub.inputs = sub.inputs[:base] + [v for j, v in enumerate(sub.inputs[base:]) if j not in consts]
        node.inputs = node.inputs[:own] + [x for j, x in enumerate(node.inputs[own:]) if j not in consts]
        node.attrs = {**node.attrs, CAPTURES: k - len(consts)}


def _plan_memory(kernels: list[Kernel], values: list[Value], alias_root: dict[int, int], inputs: set[int], outputs: set[int], concurrent: bool) -> None:
    """Liveness over alias sets: free dead values, allow in-place writes into dying operands."""
    last_use: dict[int, int] = {}
    for k in kernels:
        for vid in k.inputs:
            if vid >= 0:
                last_use[vid] = k.id
    root_last: dict[int, int] = {}
    pinned: set[int] = set()  # roots whose memory we never own or must keep: inputs, constants, outputs
    for v in values:
        root = alias_root.get(v.id, v.id)
        root_last[root] = max(root_last.get(root, -1), last_use.get(v.id, -1))
        if v.id in inputs or v.const is not None or v.id in outputs:
            pinned.add(root)
        if concurrent and v.use_count > 1:  # two readers may run in either order
            pinned.add(root)
    for k in kernels:
        allowed = set()
        for pos in INPLACE_OPERANDS.get(k.op, ()):
            if pos >= len(k.inputs) or k.inputs[pos] < 0:
                continue
            vid = k.inputs[pos]
            root = alias_root.get(vid, vid)
            if root in pinned or root_last.get(root) != k.id or k.inputs.count(vid) > 1:
                continue
            if sum(1 for other in k.inputs if other >= 0 and alias_root.get(other, other) == root) > 1:
                continue
            allowed.add(pos)
        k.inplace = frozenset(allowed)
    for vid, kid in last_use.items():
        if vid not in outputs and values[vid].const is None and vid not in inputs:
            kernels[kid].frees.append(vid)
