"""The import graph (issue 13): no cycles between modules or between moesim's subpackages —
imports inside functions count too — and the layering the README describes: policies and
traces do not import the engine, the engine does not import the studies over many replays,
configuration does not import calibration."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moesim"


def module_graph() -> dict[str, set[str]]:
    """moesim module -> the moesim modules it imports (anywhere in its source)."""
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        graph[mod]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moesim"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("moesim")]
            for name in names:
                if name in modules and name != mod:
                    graph[mod].add(name)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "moesim"


def test_no_module_imports_itself_through_others():
    assert cycle(module_graph()) is None


def test_no_cycles_between_subpackages_and_the_layering_holds():
    pkgs: dict[str, set[str]] = defaultdict(set)
    for mod, deps in module_graph().items():
        for d in deps:
            if package(d) != package(mod) and package(mod) != "moesim":
                pkgs[package(mod)].add(package(d))
    assert cycle(pkgs) is None, pkgs
    assert "simulator" not in pkgs["policies"] | pkgs["traces"]
    assert "studies" not in pkgs["simulator"] | pkgs["policies"] | pkgs["traces"] | pkgs["config"]
    assert "calibration" not in pkgs["config"]
    assert pkgs["errors"] == set()


def test_no_function_is_longer_than_100_lines():
    """A function a reader cannot take in at once is split (issue 13)."""
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 100:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.name} ({length} lines)")
    assert long == []
