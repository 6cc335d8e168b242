"""The gateway's layout holds: its packages import each other only downwards (``LAYERS``), no
module imports itself round a cycle, no route imports another route, and nothing is added loose at
the top of ``gateway/`` without being named here. Read from the source with ``ast``; nothing is
imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

# bottom first; a unit (a package, or a module loose at the top) imports only from layers below its own
LAYERS: list[set[str]] = [
    {"errors", "aio", "metrics", "exposure", "openapi", "dashboard"},  # leaves
    {"edge", "openai_api", "routing"},  # the door and limits; the OpenAI protocol; replica routing
    {"media"},  # media parts found, fetched, decoded
    {"upstream"},  # encoder and LLM clients
    {"state"},  # what a request handler reaches
    {"pipeline"},  # the generation path
    {"routes"},  # the HTTP routes
    {"app"},
    {"__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
PACKAGES = {"edge", "media", "openai_api", "pipeline", "routes", "routing"}
LOOSE_MODULES = {"__init__", "__main__", "aio", "app", "dashboard", "errors", "exposure", "metrics", "openapi",
                 "state", "upstream"}


def module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def gateway_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(GATEWAY.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The gateway modules ``name`` imports (anywhere in the file, lazily or under TYPE_CHECKING too)."""
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
            # ``from gateway.pipeline import chat`` imports the module gateway.pipeline.chat
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import gateway.a.b`` as its nearest module
                t = t.rpartition(".")[0]
            if t.startswith("gateway.") and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = gateway_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def unit_of(module: str) -> str:
    """``gateway.pipeline.chat`` -> ``pipeline``; ``gateway.state`` -> ``state``."""
    return module.split(".")[1] if module != "gateway" else "__init__"


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


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not point down: to a unit of the same or a higher layer, or from one
    route module to another."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = unit_of(src), unit_of(dst)
            if a == b:
                if a == "routes" and dst != "gateway.routes":
                    bad.append(f"{src} -> {dst}: a route must not import another route (move the helper down)")
                continue
            if a not in RANK or b not in RANK:
                bad.append(f"{src} -> {dst}: {a if a not in RANK else b} has no place in LAYERS")
            elif RANK[b] >= RANK[a]:
                bad.append(f"{src} -> {dst}: {a} (layer {RANK[a]}) may import only layers below, not {b} "
                           f"(layer {RANK[b]})")
    return bad


def test_gateway_imports_point_down():
    assert layer_violations(import_graph()) == []


def test_gateway_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_nothing_loose_at_the_top_of_the_gateway_beyond_the_allow_list():
    loose = {p.stem for p in GATEWAY.glob("*.py")}
    packages = {p.parent.name for p in GATEWAY.glob("*/__init__.py")}
    assert loose - LOOSE_MODULES == set(), "a new module at gateway/'s top: put it in the package of its job"
    assert packages == PACKAGES
    assert (loose | packages) - {"__init__"} <= set(RANK), "every unit has a layer"


def test_the_graph_sees_the_imports_it_should():
    graph = import_graph()
    assert "gateway.pipeline.chat" in graph["gateway.routes.chat"]
    assert "gateway.routing.kv_index" in graph["gateway.routing.kv_feed"]  # a relative import
    assert "gateway.openai_api.requests" in graph["gateway.media.items"]


@pytest.mark.parametrize("graph, expected", [
    ({"gateway.openai_api.x": {"gateway.pipeline.chat"}, "gateway.pipeline.chat": set()}, "openai_api (layer 1)"),
    ({"gateway.pipeline.chat": {"gateway.routes.chat"}, "gateway.routes.chat": set()}, "pipeline (layer 5)"),
    ({"gateway.routes.a": {"gateway.routes.b"}, "gateway.routes.b": set()}, "another route"),
    ({"gateway.edge.x": {"gateway.openai_api.y"}, "gateway.openai_api.y": set()}, "edge (layer 1)"),
    ({"gateway.novel.x": {"gateway.errors"}, "gateway.errors": set()}, "novel has no place"),
])
def test_the_layer_check_catches_an_upward_or_sideways_import(graph, expected):
    (violation,) = layer_violations(graph)
    assert expected in violation


def test_the_cycle_check_catches_a_cycle():
    graph = {"gateway.pipeline.a": {"gateway.pipeline.b"}, "gateway.pipeline.b": {"gateway.pipeline.c"},
             "gateway.pipeline.c": {"gateway.pipeline.a"}, "gateway.errors": set()}
    assert find_cycle(graph) == ["gateway.pipeline.a", "gateway.pipeline.b", "gateway.pipeline.c",
                                 "gateway.pipeline.a"]
    assert find_cycle({"gateway.a": {"gateway.b"}, "gateway.b": set()}) is None
