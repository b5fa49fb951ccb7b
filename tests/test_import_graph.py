"""Imports point one way: no circle among the modules of ``src/longseq/``.

Every import statement counts, the ones inside functions too: a deferred import still makes the importer depend on
the imported module, and a circle hidden that way is still one (``runner -> utils.config -> utils.resume -> runner``
was). The graph is read from the source (``ast``), so nothing is imported to build it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "longseq"


def module_names() -> dict[str, Path]:
    """``longseq.a.b`` -> its file, for every module and package of ``src/longseq``."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules its import statements name (``from a import b`` names ``a.b`` when that is a
    module, else ``a``)."""
    names = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    targets.add(target if target in names else base)
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "longseq.utils.checkpoint" in graph["longseq.utils.resume"]  # a module-level import
    assert "longseq.attention.ops.flex" in graph["longseq.bench.cell"]  # an import inside a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_package():
    assert circles(import_graph()) == []
