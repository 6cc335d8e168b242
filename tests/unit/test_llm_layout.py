"""The LLM service's layout holds: its packages import each other only downwards (``LAYERS``), no
module imports itself round a cycle, and its top level holds packages only. Read from the source
with ``ast``; nothing is imported."""

from __future__ import annotations

import pytest

from tests.import_graph import REPO, find_cycle, import_graph, layer_violations

LLM = REPO / "llm_svc"

# bottom first; a package imports only from layers below its own
LAYERS: list[set[str]] = [
    {"types", "kernels", "parallel"},  # core types and messages; the C kernels' build; rank groups
    {"attention"},  # attention backends over the pools
    {"models"},  # forward passes
    {"loading", "parsers", "kv"},  # bundle loading; output parsers; slot pools and the prefix tree (no tensors)
    {"offload"},  # host and Redis tiers
    {"engine"},  # scheduler, runner, step, speculative decoding
    {"disagg"},  # prefill / decode hand-over: an engine's two sides, their transport
    {"core"},  # the engine core process (stepping its engine for its role) and the front's client of it
    {"backends"},  # the front's generation interface: hf and swa
    {"front"},  # the HTTP service
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def test_llm_imports_point_down():
    assert layer_violations(import_graph(LLM), RANK) == []


def without_registrations(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph less a package's imports of its own modules from its ``__init__``: a registry package
    imports its entries at the end so that they register (``attention``, ``backends``), and each
    entry imports the registry back; that is the registry's shape, not a tangle."""
    return {src: {dst for dst in targets if not dst.startswith(src + ".")} for src, targets in graph.items()}


def test_llm_has_no_import_cycle():
    assert find_cycle(without_registrations(import_graph(LLM))) is None


def test_the_top_of_llm_svc_holds_packages_only():
    loose = {p.stem for p in LLM.glob("*.py")}
    packages = {p.parent.name for p in LLM.glob("*/__init__.py")}
    assert loose == {"__init__"}, "a module at llm_svc/'s top: put it in the package of its job"
    assert packages == set(RANK), "every package has a layer"


def test_the_graph_sees_the_imports_it_should():
    graph = import_graph(LLM)
    assert "llm_svc.loading.context_len" in graph["llm_svc.loading.loader"]  # a relative import
    assert "llm_svc.core.client" in graph["llm_svc.backends.swa"]


@pytest.mark.parametrize("graph, expected", [
    ({"llm_svc.kv.radix": {"llm_svc.engine.scheduler"}, "llm_svc.engine.scheduler": set()}, "kv (layer 3)"),
    ({"llm_svc.engine.x": {"llm_svc.front.app"}, "llm_svc.front.app": set()}, "engine (layer 5)"),
    ({"llm_svc.novel.x": {"llm_svc.types.request"}, "llm_svc.types.request": set()}, "novel has no place"),
])
def test_the_layer_check_catches_an_upward_import(graph, expected):
    (violation,) = layer_violations(graph, RANK)
    assert expected in violation
