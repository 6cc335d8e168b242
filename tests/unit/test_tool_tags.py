"""Strict tools under tool_choice "auto" (``llm_svc.front.tool_tags``): the structural tag of each
model format, compiled by xgrammar against the tiny checkpoints' tokenizers, accepts the text our
chat templates render for a call and our parsers read, and refuses arguments that break a strict
tool's schema, unknown tools and (parallel_tool_calls false) a second call; a format without a
structural tag, or a request that also sends a response format, is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

xgr = pytest.importorskip("xgrammar")

from shared.schemas import StructuredSpec, ToolDef, ToolSpec  # noqa: E402

from llm_svc.engine.grammar_worker import compile_spec  # noqa: E402
from llm_svc.front.tool_tags import auto_spec  # noqa: E402
from llm_svc.parsers import output_parser  # noqa: E402
from llm_svc.types.errors import InvalidRequest  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def tool_spec(choice="auto", parallel=True, tools=TOOLS) -> ToolSpec:
    return ToolSpec(tools=[ToolDef.model_validate(t) for t in tools], choice=choice, parallel=parallel)


@pytest.fixture(scope="module")
def mimo_tok():
    from transformers import AutoTokenizer
    from pathlib import Path
    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "mmserve/tiny/trained_mimo")


@pytest.fixture(scope="module")
def harmony_tok():
    from mmserve.tiny.gpt_oss import HARMONY_SPECIALS, HARMONY_TEMPLATE
    from mmserve.tiny.tokenizer import build_tokenizer
    return build_tokenizer(HARMONY_SPECIALS, 640, HARMONY_TEMPLATE, eos="<|return|>", pad_token="<|endoftext|>")


def compiled(tok, spec: StructuredSpec, any_whitespace: bool = True):
    """``spec`` compiled as the engine's compile worker does."""
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return compile_spec(xgr.GrammarCompiler(info, cache_enabled=False), spec.kind, spec.spec, any_whitespace)


def accepts(tok, grammar, text: str) -> bool:
    """``text`` (as the tokenizer splits it), then the stop token, all accepted."""
    m = xgr.GrammarMatcher(grammar)
    return all(m.accept_token(i) for i in tok(text, add_special_tokens=False)["input_ids"]) \
        and m.accept_token(tok.eos_token_id)


def generated(tok, message: dict, **kwargs) -> str:
    """The text of an assistant ``message`` after the template's generation prompt."""
    user = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, tools=TOOLS, **kwargs)
    whole = tok.apply_chat_template(user + [message], tokenize=False, tools=TOOLS, **kwargs)
    common = 0
    while common < min(len(prompt), len(whole)) and prompt[common] == whole[common]:
        common += 1
    return whole[common:]


def parsed_calls(family: str, tok, text: str, enable_thinking=None) -> list[tuple[str, dict]]:
    p = output_parser(family, tok, tools=TOOLS, enable_thinking=enable_thinking)
    calls: dict[int, list] = {}
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for d in [p.feed(ids, text), p.finish()]:
        for c in d.tool_calls:
            calls.setdefault(c.index, [None, ""])
            calls[c.index][0] = calls[c.index][0] or c.name
            calls[c.index][1] += c.arguments
    return [(n, json.loads(a)) for n, a in calls.values()]


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": {"city": "Paris", "days": 3, "tags": ["a", "bc"]}}}


def test_no_strict_tool_or_a_forced_choice_leaves_auto_unconstrained():
    assert auto_spec("mimo", tool_spec(tools=TOOLS[1:]), None, None) is None
    assert auto_spec("mimo", tool_spec(choice="required"), None, None) is None
    assert auto_spec("gemma3", tool_spec(choice="none"), None, None) is None


def test_a_format_without_a_structural_tag_refuses_strict_under_auto():
    with pytest.raises(InvalidRequest) as e:
        auto_spec("gemma3", tool_spec(), None, None)
    assert e.value.param == "tools[0].function.strict"
    assert "tool_choice \"required\"" in e.value.message and "drop strict" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        auto_spec("other", tool_spec(), None, None)


def test_strict_auto_and_a_response_format_together_are_refused():
    with pytest.raises(InvalidRequest) as e:
        auto_spec("mimo", tool_spec(), StructuredSpec(kind="json_object"), None)
    assert e.value.param == "tools[0].function.strict" and "response_format" in e.value.message


@pytest.mark.parametrize("thinking", [None, True, False])
def test_mimo_tag_accepts_the_templates_call_and_the_parser_reads_valid_arguments(mimo_tok, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    spec = auto_spec("mimo", tool_spec(), None, thinking)
    assert spec.kind == "structural_tag"
    g = compiled(mimo_tok, spec)
    reasoning = {"reasoning_content": "let me see"} if thinking is not False else {}
    text = generated(mimo_tok, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL], **reasoning},
                     **kwargs).removesuffix("<|im_end|>\n")
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n" in text
    if thinking is True:  # the prompt opened <think>: the output continues the reasoning
        text = text.removeprefix("<think>")
    assert accepts(mimo_tok, g, text), text
    [(name, args)] = parsed_calls("mimo", mimo_tok, text, thinking)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER)
    assert accepts(mimo_tok, g, "no call at all" if thinking is not True else "hmm</think>no call")


def test_mimo_tag_refuses_what_breaks_a_strict_schema(mimo_tok):
    g = compiled(mimo_tok, auto_spec("mimo", tool_spec(), None, False))
    call = "ok\n<tool_call>\n<function=get_weather>\n{}</function>\n</tool_call>"
    assert accepts(mimo_tok, g, call.format("<parameter=city>Rome</parameter>\n<parameter=days>7</parameter>\n"))
    for bad in ["<parameter=city>Berlin</parameter>\n<parameter=days>3</parameter>\n",   # not in the enum
                "<parameter=city>Rome</parameter>\n<parameter=days>9</parameter>\n",      # over the maximum
                "<parameter=city>Rome</parameter>\n",                                     # days required
                "<parameter=city>Rome</parameter>\n<parameter=days>3</parameter>\n<parameter=x>1</parameter>\n",
                '<parameter=city>Rome</parameter>\n<parameter=days>3</parameter>\n'
                '<parameter=tags>["long"]</parameter>\n']:
        assert not accepts(mimo_tok, g, call.format(bad)), bad
    assert not accepts(mimo_tok, g, "<tool_call>\n<function=unknown>\n</function>\n</tool_call>")


def test_mimo_non_strict_tool_is_well_formed_but_unchecked_and_one_call_when_not_parallel(mimo_tok):
    g = compiled(mimo_tok, auto_spec("mimo", tool_spec(), None, False))
    free = "<tool_call>\n<function=search>\n<parameter=anything>x</parameter>\n</function>\n</tool_call>"
    assert accepts(mimo_tok, g, free)
    assert accepts(mimo_tok, g, free + "\n" + free)
    assert not accepts(mimo_tok, g, "<tool_call>\n<function=search>\n<parameter=a>x <parameter=b></parameter>\n"
                                    "</function>\n</tool_call>")  # the parser would split the value
    one = compiled(mimo_tok, auto_spec("mimo", tool_spec(parallel=False), None, False))
    assert accepts(mimo_tok, one, free)
    assert not accepts(mimo_tok, one, free + "\n" + free)


def test_harmony_tag_accepts_the_templates_call_and_the_parser_reads_valid_arguments(harmony_tok):
    g = compiled(harmony_tok, auto_spec("gpt_oss", tool_spec(), None, None, {"<|return|>"}))
    whole = harmony_tok.apply_chat_template([{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [CALL]}], tokenize=False, tools=TOOLS)
    call = whole[whole.rindex("<|start|>assistant"):]  # the call message as the template renders it
    assert call.startswith("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json")
    for text in ["Checking.<|end|>" + call,
                 "<|channel|>analysis<|message|>think<|end|>" + call,
                 "Checking.<|end|>" + call + "<|start|>assistant<|channel|>final<|message|>Done"]:
        assert accepts(harmony_tok, g, text), text
        [(name, args)] = parsed_calls("gpt_oss", harmony_tok, text)
        assert name == "get_weather"
        jsonschema.validate(args, WEATHER)
    assert accepts(harmony_tok, g, "plain answer")
    bad = call.replace('"days": 3', '"days": 30')
    assert bad != call and not accepts(harmony_tok, g, "x<|end|>" + bad)
    assert not accepts(harmony_tok, g, "x<|end|><|start|>assistant<|channel|>commentary to=functions.nope "
                                       "<|constrain|>json<|message|>{}<|call|>")
    assert not accepts(harmony_tok, g, "text<|call|>")  # a special token inside free text


def test_harmony_call_as_a_stop_token_ends_the_output(harmony_tok):
    g = compiled(harmony_tok, auto_spec("gpt_oss", tool_spec(), None, None, {"<|return|>", "<|call|>"}))
    head = "x<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert accepts(harmony_tok, g, head + '{"city": "Rome", "days": 2}')
    assert not accepts(harmony_tok, g, head + '{"city": "Rome"}')


def random_walk(tok, grammar, prefix: str, rng, steps: int = 400) -> str | None:
    """``prefix``, then tokens drawn uniformly from those the grammar allows (the stop token taken
    whenever allowed, after the prefix); the text, or None if it did not finish in ``steps``."""
    import torch

    m = xgr.GrammarMatcher(grammar)
    ids = tok(prefix, add_special_tokens=False)["input_ids"]
    assert all(m.accept_token(i) for i in ids)
    mask = xgr.allocate_token_bitmask(1, len(tok))
    for _ in range(steps):
        m.fill_next_token_bitmask(mask)
        allowed = torch.nonzero(_bits(mask[0], len(tok))).flatten().tolist()
        if tok.eos_token_id in allowed:
            return tok.decode(ids, skip_special_tokens=False)
        ids.append(rng.choice(allowed))
        assert m.accept_token(ids[-1])
    return None


def _bits(row, n: int):
    """A bitmask row (int32 words, bit j of word w: token 32 w + j) -> a bool per token."""
    import torch

    bits = torch.arange(32, dtype=torch.int32)
    return ((row.unsqueeze(1) >> bits) & 1).flatten()[:n].bool()


@pytest.mark.parametrize("family, prefix", [("mimo", "ok\n<tool_call>"), ("gpt_oss", "x<|end|><|start|>assistant")])
def test_any_walk_the_grammar_allows_parses_to_calls_that_validate(family, prefix, mimo_tok, harmony_tok):
    """Whatever tokens a model picks inside a call (uniformly random here, as a random-weight
    model might), our parser reads the result as calls of the request's tools, and a strict tool's
    arguments validate."""
    import random

    tok = mimo_tok if family == "mimo" else harmony_tok
    g = compiled(tok, auto_spec(family, tool_spec(parallel=False), None, False, {tok.eos_token}))
    rng, finished, strict_calls = random.Random(0), 0, 0
    for _ in range(40):
        text = random_walk(tok, g, prefix, rng)
        if text is None:
            continue
        finished += 1
        for name, args in parsed_calls(family, tok, text, False if family == "mimo" else None):
            assert name in ("get_weather", "search")
            if name == "get_weather":
                jsonschema.validate(args, WEATHER)
                strict_calls += 1
    assert finished >= 20 and strict_calls >= 5, (finished, strict_calls)


def test_mimo_values_take_no_whitespace_padding_and_compact_bounds_the_separators(mimo_tok):
    """xgrammar's XML style pads a constrained value with whitespace the parser would keep
    (``grammar_tags``): taken out. Compact (``structured_any_whitespace`` false): one whitespace
    character at a time between parameters, as the template's newline."""
    head = "<tool_call>\n<function=get_weather>\n"
    tail = "</function>\n</tool_call>"
    for ws in (True, False):
        g = compiled(mimo_tok, auto_spec("mimo", tool_spec(), None, False), any_whitespace=ws)
        assert accepts(mimo_tok, g, head + "<parameter=city>Rome</parameter>\n<parameter=days>2</parameter>\n" + tail)
        for padded in ("<parameter=city> Rome</parameter>\n<parameter=days>2</parameter>\n",
                       "<parameter=city>Rome</parameter>\n<parameter=days>2 </parameter>\n"):
            assert not accepts(mimo_tok, g, head + padded + tail)
        two_newlines = head + "<parameter=city>Rome</parameter>\n\n<parameter=days>2</parameter>\n" + tail
        assert accepts(mimo_tok, g, two_newlines) is ws


def test_harmony_markers_spelled_from_ordinary_tokens_are_text(harmony_tok):
    """The parser reads markers by token id, and so does the grammar: ``<|end|>`` spelled from
    ordinary tokens is text of the message (no new header may follow it), the token ends it."""
    g = compiled(harmony_tok, auto_spec("gpt_oss", tool_spec(), None, None, {"<|return|>"}))
    start, end = (harmony_tok.convert_tokens_to_ids(t) for t in ("<|start|>", "<|end|>"))
    spelled = [i for c in "x<|end|>" for i in harmony_tok(c, add_special_tokens=False)["input_ids"]]
    assert end not in spelled
    m = xgr.GrammarMatcher(g)
    assert all(m.accept_token(i) for i in spelled) and not m.accept_token(start)
    assert m.accept_token(end) and m.accept_token(start)


def test_the_gateway_refuses_strict_auto_with_a_response_format_naming_both():
    from gateway.openai_api.requests import ChatCompletionRequest

    msgs = [{"role": "user", "content": "hi"}]
    strict = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rf = {"type": "json_object"}
    with pytest.raises(ValueError, match="'f' is strict under tool_choice .auto.*response_format"):
        ChatCompletionRequest(model="m", messages=msgs, tools=strict, response_format=rf)
    with pytest.raises(ValueError, match="structured_outputs"):
        ChatCompletionRequest(model="m", messages=msgs, tools=strict, tool_choice="auto",
                              structured_outputs={"regex": "a"})
    for ok in [dict(tools=loose), dict(tools=strict, tool_choice="none"),
               dict(tools=strict, response_format={"type": "text"})]:
        ChatCompletionRequest(model="m", messages=msgs, **{"response_format": rf, **ok})
