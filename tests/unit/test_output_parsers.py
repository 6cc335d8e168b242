"""The per-family output parsers: any split of an output into feed() chunks gives the same
content, reasoning and tool calls as one feed of the whole; the tiny templates render tools the
way the families' published templates do, and plain chats exactly as before."""

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


def run(parser: OutputParser, chunks) -> dict:
    out = {"content": "", "reasoning": "", "calls": {}}
    deltas = [parser.feed(ids, text) for ids, text in chunks] + [parser.finish()]
    for d in deltas:
        out["content"] += d.content
        out["reasoning"] += d.reasoning
        for c in d.tool_calls:
            call = out["calls"].setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                assert call["id"] is None and re.fullmatch(r"call_[a-zA-Z0-9]{24}", c.id)
                call["id"], call["name"] = c.id, c.name
            call["arguments"] += c.arguments
    assert sorted(out["calls"]) == list(range(len(out["calls"])))
    assert parser.tool_calls_made == len(out["calls"])
    ids = [c["id"] for c in out["calls"].values()]
    assert len(set(ids)) == len(ids)
    out["calls"] = [(c["name"], json.loads(c["arguments"])) for c in out["calls"].values()]
    return out


@pytest.fixture(scope="module")
def harmony_tok():
    from shared.tiny.gpt_oss import HARMONY_SPECIALS, HARMONY_TEMPLATE
    from shared.tiny.tokenizer import build_tokenizer
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
    if case in MIMO_EXPECTED and thinking is not False:
        assert whole["calls"] == MIMO_EXPECTED[case]


def test_mimo_structure():
    p = lambda text, **kw: run(output_parser("mimo", None, **{"tools": TOOLS, **kw}), [([], text)])
    r = p(MIMO["reasoning"])
    assert (r["reasoning"], r["content"]) == ("Let me think.\nOK.", "\n\nThe answer is 4.")
    r = p(MIMO["two_calls"])
    assert r["content"] == "Checking." and r["reasoning"] == "need weather"
    r = p(MIMO["call_in_reasoning"])
    assert r["calls"] == [] and "<tool_call>" in r["reasoning"] and r["content"] == "Fine."
    r = p(MIMO["unterminated"])
    assert r["calls"] == [] and r["content"] == MIMO["unterminated"]
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
    if case == "call":
        assert whole["calls"] == [("get_weather", {"city": "São \"Paulo\" 東京", "days": 3,
                                                   "opts": {"a": [1, {"b": None}]}}), ("now", {})]
        assert whole["content"] == ""
    elif case == "bracket_in_string":
        assert whole["calls"] == [("get_weather", {"city": "a]b)c"})]
    else:
        assert whole["calls"] == [] and whole["content"] == text
    assert run(output_parser("gemma3", None, tools=None), [([], text)])["calls"] == []


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
        "unterminated": ('{"x": ', "", []),
        "tag_like": (text, "", []),
    }[case]
    assert (whole["content"], whole["reasoning"], whole["calls"]) == expected


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
    from shared.tiny.gpt_oss import HARMONY_TEMPLATE
    from shared.tiny.tokenizer import CHATML_TEMPLATE
    assert render(CHATML_TEMPLATE, messages=PLAIN) == FROZEN_CHATML
    assert render(HARMONY_TEMPLATE, messages=PLAIN) == FROZEN_HARMONY


def test_mimo_template_tools_history_and_thinking():
    from shared.tiny.tokenizer import CHATML_TEMPLATE
    text = render(CHATML_TEMPLATE, messages=HISTORY, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(TOOLS[0]) in text
    assert ("<|im_start|>assistant\n<think>use the tool</think>\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>Paris</parameter>\n<parameter=days>3</parameter>\n</function>\n</tool_call><|im_end|>"
            in text)
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert render(CHATML_TEMPLATE, messages=HISTORY[:1], enable_thinking=True).endswith("assistant\n<think>")
    assert render(CHATML_TEMPLATE, messages=HISTORY[:1], enable_thinking=False).endswith("assistant\n<think></think>")


def test_harmony_template_tools_history():
    from shared.tiny.gpt_oss import HARMONY_TEMPLATE
    text = render(HARMONY_TEMPLATE, messages=HISTORY, tools=TOOLS)
    assert text.startswith("<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {")
    assert "type get_weather = (_: " in text and "} // namespace functions<|end|>" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>use the tool<|end|>" in text
    assert ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris", "days": 3}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
