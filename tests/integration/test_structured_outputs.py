"""Structured outputs in the engine: every constrained output follows its grammar (a corpus of
120 JSON schemas checked with ``jsonschema``), batched with unconstrained requests that stay
exactly as they are alone, and correct under preemption, the prefix cache, aborts, min_tokens,
ignore_eos and bad grammars (a 400 for that request, the others unharmed)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llm_svc.engine.grammar import GrammarCache
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams, StructuredSpec
from mmserve.tiny.schemas import schema_corpus
from tests.integration.test_llm_engine import ListStream, make_engine, run_to_end

pytestmark = pytest.mark.integration


def _engine(lm, **cfg):
    eng = make_engine(lm, **cfg)
    eng.engine.grammars = GrammarCache(lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    return eng


def _prompt(lm, i: int) -> list[int]:
    head = lm.tokenizer("<|im_start|>user\nanswer in json<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"]
    return head + [20 + i % 500, 30 + (7 * i) % 400]


def _prep(lm, rid: str, i: int, spec: StructuredSpec | None, max_tokens: int = 800, **kw) -> PreparedRequest:
    return PreparedRequest(request_id=rid, prompt_ids=_prompt(lm, i),
                           sampling=SamplingParams(max_tokens=max_tokens, structured=spec, **kw))


def _text(s: ListStream) -> str:
    return "".join(o.text for o in s.outs if o.text)


def _json(spec_schema: dict, ws: bool = False) -> StructuredSpec:
    return StructuredSpec(kind="json", spec=json.dumps(spec_schema), any_whitespace=ws)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_of_a_schema_corpus_is_valid(mimo16, temperature):
    """120 schemas (nesting, enums, arrays, bounded numbers, strings with lengths, formats and
    patterns, $ref, anyOf), all in one engine at once, greedy and sampled: each output parses
    (strict JSON: no raw control characters) and validates, and ends by the grammar."""
    corpus = schema_corpus(120)
    eng = _engine(mimo16, max_batch_tokens=512, max_running=128, num_full=1 << 17)
    preps = [_prep(mimo16, f"s{i}", i, _json(sc), temperature=temperature, seed=i) for i, sc in enumerate(corpus)]
    streams = run_to_end(eng, preps)
    for i, sc in enumerate(corpus):
        s = streams[f"s{i}"]
        assert s.outs[-1].finish_reason == "stop", (i, _text(s)[-200:])
        jsonschema.validate(json.loads(_text(s)), sc)
    assert eng.engine.grammars.compiled == len({json.dumps(sc) for sc in corpus})
    eng.scheduler.check_integrity()
    assert not eng.scheduler.requests and eng.engine.num_live == 0


def test_regex_choice_grammar_and_json_object(mimo16):
    eng = _engine(mimo16)
    specs = {
        "regex": StructuredSpec(kind="regex", spec=r"(cat|dog)-[0-9]{2,4}"),
        "choice": StructuredSpec(kind="choice", spec=json.dumps(["red", "green", 'say "hi"'])),
        "grammar": StructuredSpec(kind="grammar", spec='root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'),
        "json_object": StructuredSpec(kind="json_object", any_whitespace=False),
    }
    streams = run_to_end(eng, [_prep(mimo16, k, n, spec, max_tokens=300) for n, (k, spec) in enumerate(specs.items())])
    assert re.fullmatch(r"(cat|dog)-[0-9]{2,4}", _text(streams["regex"]))
    assert _text(streams["choice"]) in ("red", "green", 'say "hi"')
    assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", _text(streams["grammar"]))
    assert isinstance(json.loads(_text(streams["json_object"])), dict)
    assert all(s.outs[-1].finish_reason == "stop" for s in streams.values())


def test_unconstrained_neighbours_are_untouched_and_bad_grammars_fail_alone(mimo16):
    """A constrained request, a broken regex and a broken grammar share the engine with plain
    requests: the plain ones produce exactly what they produce alone; each broken one ends with
    a 400 that says what is wrong; nothing leaks."""
    alone = run_to_end(_engine(mimo16), [_prep(mimo16, f"p{i}", i, None, max_tokens=20) for i in range(3)])
    eng = _engine(mimo16)
    mixed = [_prep(mimo16, f"p{i}", i, None, max_tokens=20) for i in range(3)] + [
        _prep(mimo16, "ok", 7, _json({"type": "object", "properties": {"a": {"type": "boolean"}},
                                      "required": ["a"], "additionalProperties": False})),
        _prep(mimo16, "bad-regex", 8, StructuredSpec(kind="regex", spec="(unclosed")),
        _prep(mimo16, "bad-grammar", 9, StructuredSpec(kind="grammar", spec="root ::= missing_rule")),
    ]
    streams = run_to_end(eng, mixed)
    for i in range(3):
        assert streams[f"p{i}"].tokens == alone[f"p{i}"].tokens
    assert json.loads(_text(streams["ok"])) in ({"a": True}, {"a": False})
    for rid, what in (("bad-regex", "regex"), ("bad-grammar", "grammar")):
        last = streams[rid].outs[-1]
        assert last.error_status == 400 and what in last.error and "Traceback" not in last.error
    eng.scheduler.check_integrity()
    kv = eng.scheduler.kv
    assert eng.engine.num_live == 0 and kv.full_pool.num_free + kv.tree.evictable_full() == kv.full_pool.num_slots


def test_preemption_and_the_prefix_cache_keep_the_grammar(mimo16):
    """Under a pool so small that requests are preempted and recomputed, and with the prefix
    cache on and off, constrained outputs are the same tokens as with room to spare."""
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "k": {"enum": ["red", "blue", "cat"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["k", "n"], "additionalProperties": False}, "minItems": 3, "maxItems": 6}
    preps = lambda: [_prep(mimo16, f"q{i}", i, _json(schema), max_tokens=150) for i in range(6)]  # noqa: E731
    roomy = run_to_end(_engine(mimo16), preps())
    tight = _engine(mimo16, num_full=300, enable_prefix_cache=True)
    got = run_to_end(tight, preps())
    assert tight.scheduler.stats()["preemptions"] > 0
    nocache = run_to_end(_engine(mimo16, enable_prefix_cache=False), preps())
    for i in range(6):
        assert got[f"q{i}"].tokens == roomy[f"q{i}"].tokens == nocache[f"q{i}"].tokens
        jsonschema.validate(json.loads(_text(roomy[f"q{i}"])), schema)


def test_min_tokens_ignore_eos_and_aborts(mimo16):
    """min_tokens cannot keep a finished grammar from ending; ignore_eos does not run past a
    completed grammar; an abort while the grammar compiles leaves nothing behind."""
    eng = _engine(mimo16)
    choice = StructuredSpec(kind="choice", spec=json.dumps(["yes", "no"]))
    streams = run_to_end(eng, [_prep(mimo16, "min", 1, choice, min_tokens=50, max_tokens=60),
                               _prep(mimo16, "ign", 2, choice, ignore_eos=True, max_tokens=60)])
    for rid in ("min", "ign"):
        assert _text(streams[rid]) in ("yes", "no") and streams[rid].outs[-1].finish_reason == "stop"
    s = ListStream("gone")
    eng.submit(_prep(mimo16, "gone", 3, _json({"type": "object", "properties": {"z": {"type": "integer"}}})), s)
    eng.abort("gone")
    for _ in range(5):
        eng.step()
    assert s.done and s.outs[-1].finish_reason == "abort"
    assert eng.engine.num_live == 0 and not eng.engine._compiling
    eng.scheduler.check_integrity()


def test_no_grammar_engine_refuses_structured_requests(mimo16):
    from llm_svc.types.errors import InvalidRequest

    eng = make_engine(mimo16)
    with pytest.raises(InvalidRequest, match="structured outputs"):
        eng.submit(_prep(mimo16, "x", 0, StructuredSpec(kind="json_object")), None)
