"""No import circles among the modules of turboquant/ and export/ (installed as turboquant.export).

A static check of the source tree: every import statement, at module level or inside a function, is an
edge, because a lazy import hides a circle rather than removing it. A package's __init__ is not implied by
importing one of its modules (the one edge Python adds that the layering does not choose).
"""

from __future__ import annotations

import ast
import pathlib

# Source folder -> the dotted package it installs as.
PACKAGES = {"turboquant": "turboquant", "export": "turboquant.export"}


def module_files(root: pathlib.Path, packages: dict[str, str]) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every .py file under the given folders."""
    modules = {}
    for folder, dotted in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([dotted, *parts])] = path
    return modules


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The module `name` denotes: itself, or the longest known prefix (from a.b import c, c a function)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                # from package import submodule names the submodule; from module import name, the module.
                targets = [f"{source}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    edges.add(resolved)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


def test_no_import_cycles(repo_root):
    modules = module_files(repo_root, PACKAGES)
    assert "turboquant.export.rewrite" in modules and "turboquant.decoder" in modules  # the tree was found
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_finds_a_cycle_through_a_lazy_relative_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from .sub.b import g\n\ndef f():\n    return g()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    (package / "c.py").write_text("from pkg.sub import b\nimport pkg.a\n")
    graph = import_graph(module_files(tmp_path, {"pkg": "pkg"}))
    assert graph["pkg.c"] == {"pkg.sub.b", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    (package / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert cycles(import_graph(module_files(tmp_path, {"pkg": "pkg"}))) == []
