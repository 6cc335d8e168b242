"""tool_choice "required": the forced JSON array read as it is generated. A call's id and name go
out once the name is complete, its arguments as pieces of the parameters' raw JSON text, and any
split of the output (one character at a time, all at once, random) gives the same calls."""

from __future__ import annotations

import json
import random

import pytest

from llm_svc.front.tool_choice import RequiredCallsParser

pytestmark = pytest.mark.unit

CASES = {
    "two_calls": ('[{"name": "get_weather", "parameters": {"city": "Paris \\"x\\" }", "days": [1, 2, {"a": "]"}]}},'
                  ' {"name": "now", "parameters": {}}]',
                  [("get_weather", {"city": 'Paris "x" }', "days": [1, 2, {"a": "]"}]}), ("now", {})]),
    "spaced": ('[ { "name" : "f" , "parameters" : { "a" : 1 } } ]', [("f", {"a": 1})]),
    "escapes": ('[{"name":"g\\u00e9","parameters":{"s":"\\u00e9}\\\\"}}]', [("gé", {"s": "é}\\"})]),
    "parameters_first": ('[{"parameters": {"x": 1}, "name": "late"}]', [("late", {"x": 1})]),
}


def _run(text: str, sizes) -> tuple[list, list]:
    """Feed ``text`` in pieces of ``sizes``; the deltas and the calls they add up to."""
    p, deltas, i = RequiredCallsParser(), [], 0
    while i < len(text):
        n = next(sizes)
        deltas += p.feed([], text[i:i + n]).tool_calls
        i += n
    deltas += p.finish().tool_calls
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id is not None:
            assert c["id"] is None, "an id is sent once, on a call's first delta"
            c["id"], c["name"] = d.id, d.name
        c["arguments"] += d.arguments
    assert p.tool_calls_made == len(calls)
    return deltas, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_split_gives_the_same_calls(case):
    text, want = CASES[case]
    for seed in range(25):
        rng = random.Random(seed)
        sizes = iter(lambda: len(text), None) if seed == 0 else iter(lambda: rng.randint(1, 7), None)
        _, calls = _run(text, sizes)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want, (case, seed)
        assert all(c["id"].startswith("call_") for c in calls)


def test_the_name_goes_out_before_the_arguments_and_they_stream():
    text = '[{"name": "f", "parameters": {"a": "one", "b": "two", "c": "three"}}]'
    deltas, calls = _run(text, iter(lambda: 1, None))
    assert deltas[0].name == "f" and deltas[0].arguments == ""
    assert len([d for d in deltas if d.arguments]) > 10  # the arguments arrive in pieces
    assert calls[0]["arguments"] == '{"a": "one", "b": "two", "c": "three"}'  # the model's own text


def test_a_call_cut_by_max_tokens_keeps_what_arrived():
    _, calls = _run('[{"name": "cut", "parameters": {"a": "ab', iter(lambda: 3, None))
    assert [(c["name"], c["arguments"]) for c in calls] == [("cut", '{"a": "ab')]
    _, calls = _run('[{"name": "cu', iter(lambda: 2, None))
    assert calls == []  # no name yet: no call
