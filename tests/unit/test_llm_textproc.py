"""Streaming detokenization (partial UTF-8), stop strings, token finish rules (sampling: test_llm_sampler.py)."""

from __future__ import annotations

import pytest

from llm_svc.engine.textproc import (
    IncrementalDetokenizer,
    OutputText,
    StopStringFilter,
    min_tokens_banned,
    token_finish_reason,
)
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


def test_a_step_that_rewrites_emitted_text_takes_the_window_rule():
    """Byte-fallback tokens: "A" alone is valid, then 0xE4 makes the byte run invalid (each byte
    U+FFFD), so the next text no longer starts with what was emitted. ``DecodeStream`` refuses
    that step; the delta is what the window gives, and later steps go on from there."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<0x41>": 0, "<0xE4>": 1, "b": 2, "c": 3, "<unk>": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    detok = IncrementalDetokenizer(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert [detok.push(t) for t in (0, 1, 2, 3)] == ["A", "", "\ufffdb", "c"]
    assert detok.flush() == ""


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



def test_min_tokens_defers_eos_and_stop_tokens():
    sp = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[7])
    assert [token_finish_reason(t, n, sp, [2]) for t, n in ((2, 1), (7, 2), (2, 3))] == [None, None, None]
    assert token_finish_reason(2, 4, sp, [2]) == "stop"
    assert token_finish_reason(7, 4, sp, [2]) == "stop"
    assert token_finish_reason(5, 8, SamplingParams(max_tokens=8, min_tokens=8), [2]) == "length"


def test_min_tokens_banned_lists_stop_ids_until_reached():
    sp = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[7])
    assert min_tokens_banned(sp, 0, [2]) == [7, 2]
    assert min_tokens_banned(sp, 1, [2]) == [7, 2]
    assert min_tokens_banned(sp, 2, [2]) == []
    assert min_tokens_banned(SamplingParams(min_tokens=2, ignore_eos=True), 0, [2]) == []
    assert min_tokens_banned(SamplingParams(), 0, [2]) == []


def test_stop_strings_are_looked_for_only_after_min_tokens(tokenizer):
    ids = tokenizer("red cat red dog", add_special_tokens=False)["input_ids"]
    n_first = len(tokenizer("red cat", add_special_tokens=False)["input_ids"])
    ot = OutputText(tokenizer, SamplingParams(stop=["red"], max_tokens=64, min_tokens=n_first))
    out = ""
    for t in ids:
        out += ot.push(t)
        if ot.stopped:
            break
    assert ot.stopped
    assert (out + ot.flush()).startswith("red cat") and "dog" not in out


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
