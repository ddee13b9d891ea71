"""autoprec's import graph, read from the source with ``ast``: circles, private names, layers.

    python benchmarks/imports.py            # the graph by layer, every circle and every private import
    python benchmarks/imports.py --edges    # also every module's imports
    python benchmarks/imports.py --package OLD/autoprec   # another copy, e.g. a commit from `git archive`

An edge is every ``import``/``from ... import`` of an autoprec module anywhere in a module, lazy ones inside
functions included: a lazy import hides a circle from the interpreter, not from the reader, and the layering
rule ("each layer imports only from below it") is about who knows whom, not about import order. Left out:
the package root's re-exports (``autoprec/__init__.py`` collects the public names, it is no layer) and imports
under ``if TYPE_CHECKING:`` (annotations only, never run). A private name is one with a leading underscore
imported from another module (``from .apply import _STATE_ATTR``); a subpackage's ``__init__`` importing
from its own private submodules is not counted, since that is how a package keeps its insides private.
tests/project/test_import_graph.py runs the same checks.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from autoprec.layering import LAYER_ORDER, layer_of

ROOT = Path(__file__).resolve().parents[1] / "autoprec"
PACKAGE = "autoprec"



def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)  # "" is the package root


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name (within the package, no 'autoprec.') that a relative or absolute import names."""
    if level == 0:
        assert module is not None
        return module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    base = name.split(".") if name else []
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + (module.split(".") if module else []))


def imports(known: dict[str, Path]) -> dict[str, list[tuple[str, str | None]]]:
    """module -> [(imported module, name taken from it or None)], lazy imports included."""
    graph: dict[str, list[tuple[str, str | None]]] = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        edges: list[tuple[str, str | None]] = []
        for node in _walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        edges.append((_resolve(name, is_package, 0, alias.name), None))
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and not (node.module or "").startswith(PACKAGE):
                    continue
                target = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    edges.append((sub, None) if sub in known else (target, alias.name))
        graph[name] = edges
    return graph


def module_edges(graph: dict[str, list[tuple[str, str | None]]]) -> dict[str, set[str]]:
    """module -> modules it imports, leaving out the package root (its re-exports are not a layer)."""
    return {m: {t for t, _ in edges if t and t != m} for m, edges in graph.items() if m}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
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
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def private_imports(graph: dict[str, list[tuple[str, str | None]]]) -> list[str]:
    """'importer <- module._name' for each private name taken from another module."""
    found = []
    for importer, edges in graph.items():
        for target, name in edges:
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            if target.startswith(importer + ".") and importer:  # a package's __init__ from its own insides
                continue
            found.append(f"{importer or PACKAGE} <- {target or PACKAGE}.{name}")
    return sorted(found)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """'importer (layer) -> module (layer)' for each import of a higher layer."""
    rank = {layer: i for i, layer in enumerate(LAYER_ORDER)}
    found = []
    for importer, targets in sorted(edges.items()):
        for target in sorted(targets):
            if rank[layer_of(target)] < rank[layer_of(importer)]:
                found.append(f"{importer} ({layer_of(importer)}) -> {target} ({layer_of(target)})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every module's imports")
    parser.add_argument("--package", type=Path, default=ROOT, help="the autoprec folder to read (default: this one)")
    args = parser.parse_args()
    graph = imports(modules(args.package.resolve()))
    edges = module_edges(graph)
    print("layers (top to bottom) and which layers each imports:")
    for layer in LAYER_ORDER:
        members = sorted(m for m in edges if layer_of(m) == layer)
        used = sorted({layer_of(t) for m in members for t in edges[m] if t in edges} - {layer},
                      key=LAYER_ORDER.index)
        print(f"  {layer:12s} {len(members):2d} modules -> {', '.join(used) or '-'}")
    found = cycles(edges)
    print(f"circles: {len(found)}")
    for component in found:
        print(f"  {len(component)} modules: {' '.join(component)}")
    private = private_imports(graph)
    print(f"private names imported across modules: {len(private)}")
    for line in private:
        print(f"  {line}")
    upward = upward_imports(edges)
    print(f"imports of a higher layer: {len(upward)}")
    for line in upward:
        print(f"  {line}")
    if args.edges:
        for m in sorted(edges):
            print(f"{m}: {' '.join(sorted(edges[m]))}")
    return 1 if found or private or upward else 0


if __name__ == "__main__":
    sys.exit(main())
