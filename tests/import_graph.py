"""The import graph of one of our packages, read from the source with ``ast`` (nothing is imported), and
the checks the layout tests make of it: imports point down a list of layers, and no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str], top: str) -> set[str]:
    """The modules of package ``top`` that ``name`` imports (anywhere in the file, lazily or under
    TYPE_CHECKING too)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from top.pkg import mod`` imports the module top.pkg.mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import top.a.b`` as its nearest module
                t = t.rpartition(".")[0]
            if t.startswith(top + ".") and t != name:
                found.add(t)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(name, path, set(modules), root.name) for name, path in modules.items()}


def unit_of(module: str) -> str:
    """``gateway.pipeline.chat`` -> ``pipeline``; ``gateway.state`` -> ``state``; ``gateway`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt, BLACK) == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if colour.get(nxt) == WHITE and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def layer_violations(graph: dict[str, set[str]], rank: dict[str, int],
                     same_unit_ok=lambda unit, src, dst: True) -> list[str]:
    """Every import that does not point down: to a unit of the same or a higher layer (``rank``:
    unit -> layer, bottom 0), or one ``same_unit_ok`` refuses inside a unit."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = unit_of(src), unit_of(dst)
            if a == b:
                if not same_unit_ok(a, src, dst):
                    bad.append(f"{src} -> {dst}: a {a} module must not import another (move the helper down)")
                continue
            if a not in rank or b not in rank:
                bad.append(f"{src} -> {dst}: {a if a not in rank else b} has no place in LAYERS")
            elif rank[b] >= rank[a]:
                bad.append(f"{src} -> {dst}: {a} (layer {rank[a]}) may import only layers below, not {b} "
                           f"(layer {rank[b]})")
    return bad
