"""The layering ARCHITECTURE.md states is the layering the code has: its import-rule table is read
here and every import of every project module is checked against it, and no import cycle exists.

Imports are read from the source (module level, inside functions and under TYPE_CHECKING alike),
so a lazy import cannot hide a dependency the rules forbid.
"""
from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "kubetrt"


def package_dirs() -> dict[str, Path]:
    """Package name -> folder, from pyproject's package-dir (the wheel's own mapping)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


def project_modules() -> dict[str, Path]:
    """Every project module by dotted name (a package's __init__ under the package's name)."""
    modules: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            if name in modules and modules[name] != path:
                continue  # a subpackage mapped to its own folder wins over a nested copy
            modules.setdefault(name, path)
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports: the deepest module each import statement names."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def deepest(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in `base`
        else:
            continue
        for t in targets:
            if t.split(".")[0] != "kubetrt":
                continue
            mod = deepest(t)
            if mod is not None and mod != name:
                found.add(mod)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


@dataclass(frozen=True)
class Rule:
    code: str
    may: tuple[str, ...]
    may_not: tuple[str, ...]


def import_rules() -> list[Rule]:
    """The table under '## Import rules' in ARCHITECTURE.md."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    rules = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = [re.findall(r"`([\w.]+)`", c) for c in cells]
        rules.append(Rule(names[0][0], tuple(names[1]), tuple(names[2])))
    return rules


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def rule_for(module: str, rules: list[Rule]) -> Rule:
    matching = [r for r in rules if within(module, r.code) and (r.code != ROOT_PACKAGE or module == ROOT_PACKAGE)]
    if not matching:
        raise AssertionError(f"{module} is covered by no row of ARCHITECTURE.md's import rules")
    return max(matching, key=lambda r: len(r.code))


def violations(graph: dict[str, set[str]], rules: list[Rule]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        rule = rule_for(module, rules)
        for target in sorted(targets):
            if target == ROOT_PACKAGE:
                continue  # the package root holds only the version: every layer may read it
            own = target == rule.code if rule.code == ROOT_PACKAGE else within(target, rule.code)
            allowed = own or any(within(target, p) for p in rule.may)
            if not allowed or any(within(target, p) for p in rule.may_not):
                found.append(f"{module} imports {target}; `{rule.code}` may import {', '.join(rule.may) or 'nothing else'}"
                             + (f" and never {', '.join(rule.may_not)}" if rule.may_not else ""))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_the_graph_sees_every_layer_and_its_imports() -> None:
    graph = import_graph()
    for package in package_dirs():
        assert package in graph, f"{package} was not read"
    assert "kubetrt.runtime.engine" in graph["kubetrt.runtime.model"]
    assert "kubetrt.runtime.package" in graph["kubetrt.runtime.onnx_import"]  # relative import resolved
    assert "kubetrt.telemetry.progress" in graph["kubetrt.pipeline.stages"]  # `from pkg import module`


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_imports_follow_the_rules_in_architecture_md() -> None:
    rules = import_rules()
    assert len(rules) >= 8, "the import-rule table in ARCHITECTURE.md was not found"
    assert violations(import_graph(), rules) == []


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
])
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_a_forbidden_import_is_reported() -> None:
    rules = [Rule("kubetrt.runtime", ("kubetrt.telemetry",), ()),
             Rule("kubetrt.runtime.kernels", ("kubetrt.runtime.errors",), ()),
             Rule("kubetrt.runtime.devices", ("kubetrt.runtime",), ("kubetrt.runtime.model",))]
    graph = {"kubetrt.runtime.kernels.nn": {"kubetrt.runtime.errors", "kubetrt.runtime.graph"},
             "kubetrt.runtime.devices.host": {"kubetrt.runtime.kernels", "kubetrt.runtime.model"},
             "kubetrt.runtime.model": {"kubetrt.serving.app"}}
    assert violations(graph, rules) == [
        "kubetrt.runtime.devices.host imports kubetrt.runtime.model; `kubetrt.runtime.devices` may import "
        "kubetrt.runtime and never kubetrt.runtime.model",
        "kubetrt.runtime.kernels.nn imports kubetrt.runtime.graph; `kubetrt.runtime.kernels` may import kubetrt.runtime.errors",
        "kubetrt.runtime.model imports kubetrt.serving.app; `kubetrt.runtime` may import kubetrt.telemetry",
    ]
