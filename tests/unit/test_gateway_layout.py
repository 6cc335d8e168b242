"""The gateway's layout holds: its packages import each other only downwards (``LAYERS``), no
module imports itself round a cycle, no route imports another route, and nothing is added loose at
the top of ``gateway/`` without being named here. Read from the source with ``ast``; nothing is
imported."""

from __future__ import annotations

import pytest

from tests.import_graph import REPO, find_cycle
from tests.import_graph import import_graph as graph_of
from tests.import_graph import layer_violations as violations

GATEWAY = REPO / "gateway"

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


def import_graph() -> dict[str, set[str]]:
    return graph_of(GATEWAY)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not point down, or from one route module to another."""
    def no_route_to_route(unit: str, src: str, dst: str) -> bool:
        return unit != "routes" or dst == "gateway.routes"

    return [v.replace("a routes module must not import another", "a route must not import another route")
            for v in violations(graph, RANK, no_route_to_route)]


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
