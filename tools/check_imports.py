"""Finds import circles among Fern's packages: prints every strongly connected component of the import graph.

Every `import` statement counts wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`), since any of them ties the two modules together for a reader and most
of them for the interpreter. Relative imports are resolved, and `from pkg import name` points
at the submodule `pkg.name` when there is one. Imports of modules outside the scanned packages
are ignored. Exit status 1 when there is a circle.

    python tools/check_imports.py                 # core_engine, sidecar, adapters, benchmarks
    python tools/check_imports.py --root DIR pkg  # other packages under another directory
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("core_engine", "sidecar", "adapters", "benchmarks")


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports `target`, at `path`:`line`."""

    source: str
    target: str
    path: Path
    line: int


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (a package is its __init__)."""
    modules: dict[str, Path] = {}
    for package in packages:
        base = root / package
        files = sorted(base.rglob("*.py")) if base.is_dir() else [root / f"{package}.py"]
        for path in files:
            if not path.is_file():
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_base(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute module an ImportFrom names before its `import` list (None past the top level)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not _is_package(path):
        parts = parts[:-1]  # a plain module's `.` is its package
    drop = node.level - 1
    if drop >= len(parts):
        return None
    parts = parts[: len(parts) - drop]
    return ".".join(parts + ([node.module] if node.module else []))


def _local(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is one of the scanned modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def module_imports(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The imports of scanned modules that one file makes, each with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    edges: list[Edge] = []

    def add(target: str | None, line: int) -> None:
        edge = Edge(module, target, path, line) if target is not None and target != module else None
        if edge is not None and edge not in edges:  # `from m import a, b` is one import of m
            edges.append(edge)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_local(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, path, node)
            if base is None:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                add(submodule if submodule in modules else _local(base, modules), node.lineno)
    return edges


def import_graph(root: Path, packages: Iterable[str]) -> tuple[dict[str, set[str]], list[Edge]]:
    """Adjacency (module -> modules it imports) over the scanned packages, and every edge with its place."""
    modules = find_modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    edges: list[Edge] = []
    for name, path in modules.items():
        for edge in module_imports(name, path, modules):
            graph[name].add(edge.target)
            edges.append(edge)
    return graph, edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; components sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph[start]))))
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def circles(root: Path, packages: Iterable[str] = PACKAGES) -> list[tuple[list[str], list[Edge]]]:
    """Each import circle (a component of more than one module) with the imports that close it."""
    graph, edges = import_graph(root, packages)
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            members = set(component)
            inside = [e for e in edges if e.source in members and e.target in members]
            found.append((component, sorted(inside, key=lambda e: (e.source, e.target, e.line))))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="directory holding the packages (default: the repository)")
    parser.add_argument("packages", nargs="*", default=list(PACKAGES), help="top-level packages to scan")
    args = parser.parse_args(argv)
    found = circles(args.root, args.packages)
    for component, inside in found:
        print(f"circle of {len(component)}: {', '.join(component)}")
        for edge in inside:
            print(f"  {edge.source} -> {edge.target}  ({edge.path.relative_to(args.root)}:{edge.line})")
    if found:
        print(f"{len(found)} import circle(s)")
        return 1
    print("no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
