"""Streaming detokenization (partial UTF-8), stop strings, token finish rules (sampling: test_llm_sampler.py)."""

from __future__ import annotations

import pytest

from llm_svc.textproc import IncrementalDetokenizer, OutputText, StopStringFilter, token_finish_reason
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(mimo_bundle):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(mimo_bundle)


def test_multibyte_characters_are_held_until_complete(tokenizer):
    text = "héllo 世界 🙂 ok ünïcödé"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") > 0  # byte-level tokens split characters: some steps emit nothing


def test_special_tokens_are_not_emitted(tokenizer):
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(t) for t in ids) + detok.flush() == "hello"


@pytest.mark.parametrize("pieces", [["Hel", "lo W", "orld"], ["H", "e", "l", "l", "o", " ", "W", "o"], ["Hello World"]])
def test_stop_string_never_emitted_in_any_split(pieces):
    f = StopStringFilter(["o W"])
    out = "".join(f.push(p) for p in pieces) + f.flush()
    assert out == "Hell"
    assert f.stopped


def test_held_prefix_is_released_when_it_diverges():
    f = StopStringFilter(["STOP"])
    assert f.push("abc ST") == "abc "  # "ST" could start STOP: held
    assert f.push("ART") == "START"
    assert not f.stopped
    assert f.push("x S") == "x "
    assert f.flush() == "S"  # the end of generation releases what was held


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(["world", "lo"])
    assert f.push("hello world") == "hel"


def test_output_text_stops_across_tokens(tokenizer):
    ids = tokenizer("the cat is red and blue", add_special_tokens=False)["input_ids"]
    ot = OutputText(tokenizer, SamplingParams(stop=["red"]))
    out = ""
    for t in ids:
        out += ot.push(t)
        if ot.stopped:
            break
    assert ot.stopped and out + ot.flush() == "the cat is "


def test_token_finish_reason_rules():
    sp = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert token_finish_reason(7, 1, sp, [2]) == "stop"
    assert token_finish_reason(2, 1, sp, [2]) == "stop"
    assert token_finish_reason(5, 2, sp, [2]) is None
    assert token_finish_reason(5, 3, sp, [2]) == "length"
    assert token_finish_reason(2, 1, SamplingParams(ignore_eos=True), [2]) is None

