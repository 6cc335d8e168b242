"""The per-family output parsers: any split of an output into feed() chunks gives the same
content, reasoning and tool calls as one feed of the whole; a call's id and name come on its
first delta only and its argument fragments concatenate to its JSON arguments; fed piecewise, a
call's name comes before its end and its parameters as they complete. The tiny templates render
tools the way the families' published templates do, and plain chats exactly as before."""

from __future__ import annotations

import json
import random
import re

import pytest

from llm_svc.parsers import OutputParser, family_of, output_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "opts": {"type": "object"}, "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]

MIMO = {
    "plain": "Hello world, no tags here.",
    "reasoning": "<think>Let me think.\nOK.</think>\n\nThe answer is 4.",
    "two_calls": ("<think>need weather</think>Checking.\n<tool_call>\n<function=get_weather>\n"
                  "<parameter=city>São \"Paulo\" 東京</parameter>\n<parameter=days>3</parameter>\n"
                  "<parameter=opts>{\"a\": [1, {\"b\": null}]}</parameter>\n<parameter=zip>01234</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>"),
    "call_in_reasoning": ("<think>maybe <tool_call><function=now></function></tool_call> later</think>"
                          "Fine."),
    "unterminated": "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>Rome",
    "tag_like": "a < b and <toolbox> or <think about it> </thin",
}
GEMMA = {
    "plain": "Just text [not a call] here.",
    "call": '[get_weather(city="São \\"Paulo\\" 東京", days=3, opts={"a": [1, {"b": None}]}), now()]',
    "bad_list": "[1, 2, 3] is a list",
    "unterminated": '[get_weather(city="Ro',
    "bracket_in_string": '[get_weather(city="a]b)c")]',
}
HARMONY = {
    "plain": "Just the final answer.",
    "reasoning": "<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "It is 4.<|return|>",
    "two_calls": ("<|channel|>analysis<|message|>need tools<|end|><|start|>assistant<|channel|>commentary "
                  "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"São 東京\", \"opts\": "
                  "{\"a\": [1]}}<|call|><|start|>assistant<|channel|>commentary to=functions.now "
                  "<|constrain|>json<|message|>{}<|call|>"),
    "unterminated": "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{\"x\": ",
    "tag_like": "a <|chan and to=functions.x text",
}


def mimo_chunks(text: str, rng: random.Random) -> list[tuple[list[int], str]]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [([], text[a:b]) for a, b in zip([0] + cuts, cuts + [len(text)])]


def run(parser: OutputParser, chunks, fragments: dict | None = None) -> dict:
    """Content, reasoning and calls (name, arguments parsed as JSON, or the text where it is not
    JSON); ``fragments`` (if given) gets each call's argument fragments, in order."""
    out = {"content": "", "reasoning": "", "calls": {}}
    deltas = [parser.feed(ids, text) for ids, text in chunks] + [parser.finish()]
    for d in deltas:
        out["content"] += d.content
        out["reasoning"] += d.reasoning
        for c in d.tool_calls:
            call = out["calls"].get(c.index)
            if call is None:  # the first delta: id and name
                assert re.fullmatch(r"call_[a-zA-Z0-9]{24}", c.id) and c.name, c
                call = out["calls"][c.index] = {"id": c.id, "name": c.name, "arguments": ""}
            else:
                assert c.id is None and c.name is None, c
                if fragments is not None:
                    fragments.setdefault(c.index, []).append(c.arguments)
            call["arguments"] += c.arguments
    assert sorted(out["calls"]) == list(range(len(out["calls"])))
    assert parser.tool_calls_made == len(out["calls"])
    ids = [c["id"] for c in out["calls"].values()]
    assert len(set(ids)) == len(ids)
    out["arguments"] = [c["arguments"] for c in out["calls"].values()]
    out["calls"] = [(c["name"], _json_or_text(c["arguments"])) for c in out["calls"].values()]
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@pytest.fixture(scope="module")
def harmony_tok():
    from mmserve.tiny.gpt_oss import HARMONY_SPECIALS, HARMONY_TEMPLATE
    from mmserve.tiny.tokenizer import build_tokenizer
    return build_tokenizer(HARMONY_SPECIALS, 640, HARMONY_TEMPLATE, eos="<|return|>", pad_token="<|endoftext|>")


def harmony_chunks(tok, text: str, rng: random.Random):
    ids = tok.encode(text, add_special_tokens=False)
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(1, 12)))) if len(ids) > 1 else []
    parts = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
    return [(p, tok.decode(p, skip_special_tokens=True)) for p in parts]


MIMO_EXPECTED = {
    "two_calls": [("get_weather", {"city": "São \"Paulo\" 東京", "days": 3, "opts": {"a": [1, {"b": None}]},
                                   "zip": "01234"}), ("now", {})],
}


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("case", sorted(MIMO))
def test_mimo_any_split_equals_one_shot(case, thinking):
    text = MIMO[case]
    if thinking is True:
        text = text.removeprefix("<think>")  # the prompt opened it
    whole = run(output_parser("mimo", None, tools=TOOLS, enable_thinking=thinking), [([], text)])
    rng = random.Random(f"{case}-{thinking}")
    for _ in range(25):
        assert run(output_parser("mimo", None, tools=TOOLS, enable_thinking=thinking), mimo_chunks(text, rng)) == whole
    assert all(isinstance(args, dict) for _, args in whole["calls"])
    if case in MIMO_EXPECTED and thinking is not False:
        assert whole["calls"] == MIMO_EXPECTED[case]
        assert whole["arguments"] == [json.dumps(a, ensure_ascii=False) for _, a in MIMO_EXPECTED[case]]


MIMO_EDGES = {  # case: (output, content, calls); our decisions, so not compared with vLLM
    "duplicate_key": ("<tool_call><function=get_weather><parameter=city>A</parameter><parameter=days>2</parameter>"
                      "<parameter=city>B</parameter></function></tool_call>", "",
                      [("get_weather", {"city": "A", "days": 2})]),  # the first value stays
    "functions_in_one_body": ("<tool_call>\n<function=now>\n</function>\n<function=get_weather>\n<parameter=days>2\n"
                              "<parameter=city>Oslo\n</function>\n</tool_call>", "",
                              [("now", {}), ("get_weather", {"days": 2, "city": "Oslo"})]),
    "no_function": ("Text <tool_call>not a call</tool_call> more", "Text <tool_call>not a call</tool_call> more", []),
    "empty_name": ("<tool_call><function= ><parameter=a>1</parameter></function><function=now></function></tool_call>",
                   "", [("now", {})]),
    "no_closing_tags": ("<tool_call><function=get_weather><parameter=days>3\n</tool_call>", "",
                        [("get_weather", {"days": 3})]),
    "unterminated_after_param": ("Sure.<tool_call><function=get_weather><parameter=city>Rome</parameter>"
                                 "<parameter=days>4", "Sure.", [("get_weather", {"city": "Rome"})]),
    "unterminated_before_function": ("Sure.\n<tool_call>\n<funct", "Sure.\n<tool_call>\n<funct", []),
}


@pytest.mark.parametrize("case", sorted(MIMO_EDGES))
def test_mimo_edge_cases(case):
    text, content, calls = MIMO_EDGES[case]
    whole = run(output_parser("mimo", None, tools=TOOLS), [([], text)])
    assert (whole["content"], whole["calls"]) == (content, calls)
    assert whole["arguments"] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    rng = random.Random(case)
    for _ in range(25):
        assert run(output_parser("mimo", None, tools=TOOLS), mimo_chunks(text, rng)) == whole


def char_by_char(parser: OutputParser, text: str) -> list[tuple[int, object]]:
    """(characters fed so far, delta) for each tool-call delta, fed one character at a time."""
    seen = [(i + 1, d) for i in range(len(text)) for d in parser.feed([], text[i]).tool_calls]
    return seen + [(len(text), d) for d in parser.finish().tool_calls]


def test_mimo_streams_the_name_then_each_parameter():
    text = MIMO["two_calls"]
    seen = char_by_char(output_parser("mimo", None, tools=TOOLS), text)
    first = [(n, d) for n, d in seen if d.index == 0]
    assert first[0][0] == text.index("<function=get_weather>") + len("<function=get_weather>")
    assert (first[0][1].name, first[0][1].arguments) == ("get_weather", "")
    assert [d.arguments for _, d in first[1:]] == ['{"city": "São \\"Paulo\\" 東京"', ', "days": 3',
                                                  ', "opts": {"a": [1, {"b": null}]}', ', "zip": "01234"', "}"]
    assert [n for n, _ in first[1:5]] == [m.end() for m in re.finditer("</parameter>", text)]
    assert first[5][0] == text.index("</function>") + len("</function>")
    assert [(d.name, d.arguments) for _, d in seen if d.index == 1] == [("now", ""), (None, "{}")]


def test_mimo_structure():
    p = lambda text, **kw: run(output_parser("mimo", None, **{"tools": TOOLS, **kw}), [([], text)])
    r = p(MIMO["reasoning"])
    assert (r["reasoning"], r["content"]) == ("Let me think.\nOK.", "\n\nThe answer is 4.")
    r = p(MIMO["two_calls"])
    assert r["content"] == "Checking." and r["reasoning"] == "need weather"
    r = p(MIMO["call_in_reasoning"])
    assert r["calls"] == [] and "<tool_call>" in r["reasoning"] and r["content"] == "Fine."
    r = p(MIMO["unterminated"])  # the name was sent: a call, with the parameters complete by then
    assert r["calls"] == [("get_weather", {})] and r["content"] == "Sure."
    assert p(MIMO["tag_like"])["content"] == MIMO["tag_like"]
    r = p(MIMO["two_calls"], tools=None)  # no tools: call text stays content
    assert r["calls"] == [] and "<tool_call>" in r["content"]
    r = p(MIMO["reasoning"], reasoning=False)
    assert r["reasoning"] == "" and r["content"] == MIMO["reasoning"]
    r = p("<think>x</think>y", enable_thinking=False)
    assert r["content"] == "<think>xy" and r["reasoning"] == ""  # a stray </think> is dropped
    assert p("plain", enable_thinking=True)["reasoning"] == "plain"


@pytest.mark.parametrize("case", sorted(GEMMA))
def test_gemma_any_split_equals_one_shot(case):
    text = GEMMA[case]
    whole = run(output_parser("gemma3", None, tools=TOOLS), [([], text)])
    rng = random.Random(len(text))
    for _ in range(25):
        assert run(output_parser("gemma3", None, tools=TOOLS), mimo_chunks(text, rng)) == whole
    assert all(isinstance(args, dict) for _, args in whole["calls"])
    if case == "call":
        assert whole["calls"] == [("get_weather", {"city": "São \"Paulo\" 東京", "days": 3,
                                                   "opts": {"a": [1, {"b": None}]}}), ("now", {})]
        assert whole["content"] == ""
    elif case == "bracket_in_string":
        assert whole["calls"] == [("get_weather", {"city": "a]b)c"})]
    else:
        assert whole["calls"] == [] and whole["content"] == text
    assert run(output_parser("gemma3", None, tools=None), [([], text)])["calls"] == []


GEMMA_EDGES = {  # case: (output, content, calls)
    "text_after": ("[now()] and more", " and more", [("now", {})]),
    "trailing_comma": ("[now(),]", "", [("now", {})]),
    "later_not_a_call": ("[now(), 5] tail", " 5] tail", [("now", {})]),
    "unterminated_second": ('[now(), get_weather(city="Ro', ' get_weather(city="Ro', [("now", {})]),
    "positional": ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
    "paren_closes": ("[now)", "[now)", []),
    "empty": ("[]", "[]", []),
}


@pytest.mark.parametrize("case", sorted(GEMMA_EDGES))
def test_gemma_edge_cases(case):
    text, content, calls = GEMMA_EDGES[case]
    whole = run(output_parser("gemma3", None, tools=TOOLS), [([], text)])
    assert (whole["content"], whole["calls"]) == (content, calls)
    rng = random.Random(case)
    for _ in range(25):
        assert run(output_parser("gemma3", None, tools=TOOLS), mimo_chunks(text, rng)) == whole


def test_gemma_sends_each_call_before_the_list_closes():
    text = GEMMA["call"]
    seen = char_by_char(output_parser("gemma3", None, tools=TOOLS), text)
    assert [(n, d.name) for n, d in seen] == [(text.index("), now()") + 2, "get_weather"), (len(text), "now")]


@pytest.mark.parametrize("case", sorted(HARMONY))
def test_harmony_any_split_equals_one_shot(case, harmony_tok):
    text = HARMONY[case]
    ids = harmony_tok.encode(text, add_special_tokens=False)
    whole = run(output_parser("gpt_oss", harmony_tok, tools=TOOLS), [(ids, harmony_tok.decode(ids, skip_special_tokens=True))])
    rng = random.Random(len(text))
    for _ in range(25):
        assert run(output_parser("gpt_oss", harmony_tok, tools=TOOLS), harmony_chunks(harmony_tok, text, rng)) == whole
    expected = {
        "plain": ("Just the final answer.", "", []),
        "reasoning": ("It is 4.", "Think hard.", []),
        "two_calls": ("", "need tools", [("get_weather", {"city": "São 東京", "opts": {"a": [1]}}), ("now", {})]),
        "unterminated": ("", "", [("now", '{"x": ')]),  # a cut call stays one, as far as it got
        "tag_like": (text, "", []),
    }[case]
    assert (whole["content"], whole["reasoning"], whole["calls"]) == expected


HARMONY_EDGES = {  # case: (output, content, calls)
    "not_an_object": ("<|channel|>commentary to=functions.now <|constrain|>json<|message|> 5<|call|>", "",
                      [("now", {"value": 5})]),
    "empty_body": ("<|channel|>commentary to=functions.now <|constrain|>json<|message|><|call|>", "", [("now", {})]),
    "whitespace_around": ('<|channel|>commentary to=functions.now <|constrain|>json<|message|>\n {"a": 1}\n<|call|>',
                          "", [("now", {"a": 1})]),
    "end_tag_missing": ("<|channel|>commentary to=functions.now<|message|>[1]<|start|>assistant<|channel|>final"
                        "<|message|>ok", "ok", [("now", {"value": [1]})]),
}


@pytest.mark.parametrize("case", sorted(HARMONY_EDGES))
def test_harmony_edge_cases(case, harmony_tok):
    text, content, calls = HARMONY_EDGES[case]
    ids = harmony_tok.encode(text, add_special_tokens=False)
    whole = run(output_parser("gpt_oss", harmony_tok, tools=TOOLS), [(ids, "")])
    assert (whole["content"], whole["calls"]) == (content, calls)
    rng = random.Random(case)
    for _ in range(25):
        assert run(output_parser("gpt_oss", harmony_tok, tools=TOOLS), harmony_chunks(harmony_tok, text, rng)) == whole


def test_harmony_streams_the_name_then_the_body(harmony_tok):
    ids = harmony_tok.encode(HARMONY["two_calls"], add_special_tokens=False)
    p = output_parser("gpt_oss", harmony_tok, tools=TOOLS)
    seen = [(i, d) for i, t in enumerate(ids) for d in p.feed([t], "").tool_calls]
    message, call = harmony_tok.convert_tokens_to_ids("<|message|>"), harmony_tok.convert_tokens_to_ids("<|call|>")
    first = [(i, d) for i, d in seen if d.index == 0]
    assert ids[first[0][0]] == message and first[0][1].name == "get_weather"
    body = [d.arguments for i, d in first[1:] if i < ids.index(call)]
    assert len(body) > 1 and "".join(body) == '{"city": "São 東京", "opts": {"a": [1]}}'


def test_harmony_without_tools_and_reasoning_flag(harmony_tok):
    ids = harmony_tok.encode(HARMONY["two_calls"], add_special_tokens=False)
    r = run(output_parser("gpt_oss", harmony_tok, tools=None, reasoning=False), [(ids, "")])
    assert r["calls"] == [] and r["reasoning"] == "need tools" and "São" in r["content"]


def test_registry():
    assert [family_of(a) for a in ("mimo", "gemma3", "gpt_oss", "other")] == ["mimo", "gemma3", "gpt_oss", None]
    assert output_parser("llama", None, tools=None) is None


# frozen renderings of the templates before tools were added (other tests depend on them)
PLAIN = [{"role": "system", "content": "sys"},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "audio"}]},
         {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
FROZEN_CHATML = ("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\na<|vision_start|><|image_pad|><|vision_end|>"
                 "<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
                 "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
FROZEN_HARMONY = ("<|start|>system<|message|>sys<|end|><|start|>user<|message|>a<|end|><|start|>assistant<|message|>ok"
                  "<|end|><|start|>user<|message|>more<|end|><|start|>assistant<|channel|>final<|message|>")
HISTORY = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": "", "reasoning_content": "use the tool",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def render(template: str, **kw) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template
    return _compile_jinja_template(template).render(add_generation_prompt=True, **kw)


def test_templates_plain_chat_unchanged():
    from mmserve.tiny.gpt_oss import HARMONY_TEMPLATE
    from mmserve.tiny.tokenizer import CHATML_TEMPLATE
    assert render(CHATML_TEMPLATE, messages=PLAIN) == FROZEN_CHATML
    assert render(HARMONY_TEMPLATE, messages=PLAIN) == FROZEN_HARMONY


def test_mimo_template_tools_history_and_thinking():
    from mmserve.tiny.tokenizer import CHATML_TEMPLATE
    text = render(CHATML_TEMPLATE, messages=HISTORY, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(TOOLS[0]) in text
    assert ("<|im_start|>assistant\n<think>use the tool</think>\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>Paris</parameter>\n<parameter=days>3</parameter>\n</function>\n</tool_call><|im_end|>"
            in text)
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert render(CHATML_TEMPLATE, messages=HISTORY[:1], enable_thinking=True).endswith("assistant\n<think>")
    assert render(CHATML_TEMPLATE, messages=HISTORY[:1], enable_thinking=False).endswith("assistant\n<think></think>")


def test_harmony_template_tools_history():
    from mmserve.tiny.gpt_oss import HARMONY_TEMPLATE
    text = render(HARMONY_TEMPLATE, messages=HISTORY, tools=TOOLS)
    assert text.startswith("<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {")
    assert "type get_weather = (_: " in text and "} // namespace functions<|end|>" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>use the tool<|end|>" in text
    assert ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris", "days": 3}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
