"""A prompt that cannot fit ``max_model_len`` is refused without tokenizing all of it, with a
real-size vocabulary: a 50k-token byte-level BPE trained here, whose longest tokens are runs of
256 bytes (as GPT-4's and Qwen's), so ``bytes / longest token`` alone lets 8 MB through."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llm_svc.loading import prompt_bound
from llm_svc.types.errors import InvalidRequest
from llm_svc.loading.loader import load_lm
from llm_svc.front.prompt import prepare_request, render_prompt_text
from llm_svc.loading.prompt_bound import TokenBound, chunked_at_least, tokens_past
from llm_svc.front.routes import _prepare
from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from shared.wire import pack
from mmserve.testing.real_bpe import pseudo_words as _words, train_real_size_bpe

pytestmark = pytest.mark.unit

@pytest.fixture(scope="module")
def bpe():
    """ChatML specials at ids 0-9 (as the tiny MiMo's), pseudo-word sentences and runs of up to
    256 dashes, spaces, '=', '#', '*' (about 2 s to train)."""
    fast = train_real_size_bpe(50000)
    assert len(fast) == 50000
    return fast


@pytest.fixture(scope="module")
def lm(bpe, mimo_bundle):
    """The tiny MiMo's front (no weights) with the real-size vocabulary."""
    base = load_lm(str(mimo_bundle), weights=False)
    return dataclasses.replace(base, tokenizer=bpe, bound=TokenBound.of(bpe), vocab_size=len(bpe))


def _count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _texts(seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    words = _words(20000, 0)
    return {
        "words": " ".join(rng.choice(words) for _ in range(6000)),
        "glued": "".join(rng.choice(words) for _ in range(6000)),
        "runs": "".join(rng.choice("-=x #*\n.") * rng.randint(1, 700) for _ in range(150)),
        "digits": "".join(str(rng.randint(0, 10**9)) for _ in range(5000)),
        "cjk": "".join(chr(rng.randint(0x4E00, 0x4E40)) for _ in range(12000)),
        "mixed": "".join(rng.choice([rng.choice(words), " ", "  ", "\n", "\t", ".", ", ", str(rng.randint(0, 999)),
                                     rng.choice("-=") * rng.randint(1, 300)]) for _ in range(6000)),
        "specials": "".join(rng.choice([rng.choice(words), "<|im_end|>", "<|im_start|>", "x" * rng.randint(1, 50)])
                            for _ in range(5000)),
    }


def test_the_vocabulary_is_real_size_and_its_longest_token_makes_the_bytes_bound_weak(lm):
    assert lm.bound.max_bytes == 256  # a run of 256 dashes or spaces
    # the bound that used to be the only one: 8 MB is "at least 31,250 tokens", under a 32K context
    assert lm.min_tokens(8_000_000) + 64 <= 32768
    assert len(lm.bound.max_changes) == len(prompt_bound.PERIODS)
    assert max(lm.bound.max_changes) < 64  # the longest tokens are runs: they change nowhere


@pytest.mark.parametrize("seed", [1, 2])
def test_byte_changes_bound_the_tokens_from_below(bpe, seed):
    bound = TokenBound.of(bpe)
    for kind, text in _texts(seed).items():
        n = _count(bpe, text)
        assert bound.at_least(text) <= n, kind
    words = _texts(seed)["words"]
    assert bound.at_least(words) > 4 * len(words.encode()) // bound.max_bytes  # far tighter on text


@pytest.mark.parametrize("chunk", [256, 1000, 4096])
def test_chunk_counts_less_the_cuts_bound_the_tokens_from_below(bpe, chunk, monkeypatch):
    """Many cuts (small chunks): before spaces, and hard ones inside runs, glued words, numbers,
    CJK and special tokens; the whole text's count is never below the chunked bound."""
    monkeypatch.setattr(prompt_bound, "CHUNK_CHARS", chunk)
    monkeypatch.setattr(prompt_bound, "CUT_WINDOW", chunk // 4)
    for kind, text in _texts(chunk).items():
        n = _count(bpe, text)
        lower = chunked_at_least(bpe, text, budget=1 << 40)
        assert lower <= n, (kind, lower, n)
        if chunk >= 4096:  # the service's chunks are 16K: little is lost to the cuts
            assert lower >= n * 0.9, (kind, lower, n)
    monkeypatch.setattr(prompt_bound, "SPACE_CUT_SLACK", 0)
    words = _texts(chunk)["words"]
    assert chunked_at_least(bpe, words, budget=1 << 40) == _count(bpe, words)  # space cuts are exact here


def _chat(text: str, max_tokens: int = 64) -> GenerateRequest:
    return GenerateRequest(request_id="r", sampling=SamplingParams(max_tokens=max_tokens),
                           messages=[PromptMessage(role="user", content=[PromptText(text=text)])])


class _CountingTokenizer:
    """The tokenizer, counting the characters it is asked to tokenize (how much work a refusal
    did, measured without a clock: timings are for benchmarks, ``benchmarks.front_isolation``)."""

    def __init__(self, tok):
        self._tok, self.chars = tok, 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, *a, **kw):
        self.chars += len(text) if isinstance(text, str) else sum(len(t) for t in text)
        return self._tok(text, *a, **kw)

    def encode(self, text, *a, **kw):
        self.chars += len(text)
        return self._tok.encode(text, *a, **kw)

    def apply_chat_template(self, *a, **kw):
        if kw.get("tokenize", True):
            raise AssertionError("the whole conversation was tokenized")
        return self._tok.apply_chat_template(*a, **kw)


def _refusal(lm, fn) -> tuple[int, InvalidRequest]:
    """``fn(lm)`` must raise ``InvalidRequest``; returns the characters it tokenized and the error."""
    counting = _CountingTokenizer(lm.tokenizer)
    with pytest.raises(InvalidRequest) as e:
        fn(dataclasses.replace(lm, tokenizer=counting))
    return counting.chars, e.value


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_8_mb_prompt_is_a_400_naming_max_model_len_without_tokenizing_it(lm, kind):
    """The LLM front's whole preparation of the body (header check, unpack, template, bounds) on
    a 32K context, where the bytes bound alone would have tokenized all 8 MB (6.2 s measured):
    the byte-changes bound ("at least 509,868 tokens") refuses it with no tokenizer call. Time
    (not asserted here): 24-44 ms for both on a shared 2-core machine."""
    words = _words(20000, 1)
    rng = random.Random(1)
    text = " ".join(rng.choice(words) for _ in range(1_400_000))[:8_000_000]
    if kind == "chat":
        req = _chat(text)
    else:
        req = GenerateRequest(request_id="r", prompt=text, sampling=SamplingParams(max_tokens=64))
    body = pack({}, req)
    chars, err = _refusal(lm, lambda lm_: _prepare(lm_, body, 32768))
    assert err.code == "context_length_exceeded" and "max_model_len=32768" in err.message, err.message
    assert chars == 0, chars


def test_a_run_of_x_is_refused_by_counting_chunks(lm):
    """8 MB of one character changes nowhere: the chunked count refuses it after tokenizing about
    33K characters, not 8M (26-31 ms measured; the whole text would take about 12 s)."""
    req = _chat("x" * 8_000_000)
    chars, err = _refusal(lm, lambda lm_: prepare_request(lm_, req, {}, 32768))
    assert err.code == "context_length_exceeded" and "max_model_len=32768" in err.message, err.message
    assert 0 < chars <= 4 * prompt_bound.CHUNK_CHARS, chars


@pytest.mark.parametrize("text", ["words", "runs"])
def test_a_prompt_at_the_limit_passes_and_one_token_more_is_refused(lm, text, monkeypatch):
    """The chunked count forced (small chunks, every length): exactly max_model_len passes."""
    monkeypatch.setattr(prompt_bound, "EAGER_CHARS_PER_TOKEN", 0)
    monkeypatch.setattr(prompt_bound, "CHUNK_CHARS", 1024)
    rng = random.Random(3)
    words = _words(20000, 2)
    if text == "words":
        body = " ".join(rng.choice(words) for _ in range(3000))
    else:  # long tokens: about 256 bytes each
        body = " ".join("-" * rng.randint(200, 2000) + " " + rng.choice(words) for _ in range(200))
    req = _chat(body, max_tokens=10)
    n = _count(lm.tokenizer, render_prompt_text(lm, req))
    assert len(body) > 8 * n or text == "words"
    prep = prepare_request(lm, req, {}, n + 10)
    assert len(prep.prompt_ids) == n
    with pytest.raises(InvalidRequest) as e:
        prepare_request(lm, req, {}, n + 9)
    assert e.value.code == "context_length_exceeded"
    assert tokens_past(lm.tokenizer, lm.bound, render_prompt_text(lm, req), n) is None


def _header_bytes_and_backslashes(body: bytes) -> tuple[int, int]:
    n = int.from_bytes(body[:8], "little")
    return n, body.count(b"\\", 8, 8 + n)


def test_the_header_bound_never_counts_more_text_than_the_prompt_has():
    """The LLM front's pre-parse bound (``routes._prepare``): the prompt's text bytes are at least
    the header's bytes less ``_ESCAPE_LOSS`` per backslash and at least a 7th of them, for text of
    any escapes (control characters, quotes, backslashes, non-ASCII, astral), with a structure
    overhead far below the slack."""
    from llm_svc.front import routes

    rng = random.Random(11)
    alphabet = ["a", " ", "\n", "\t", "\"", "\\", "\x01", "\x1f", "é", "中", "😀", "/", "<", "\u2028"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
        body = pack({}, _chat(text))
        n, bs = _header_bytes_and_backslashes(body)
        real = len(text.encode())
        overhead = 4096  # the request's own JSON: far below routes._HEADER_SLACK
        assert real >= n - overhead - routes._ESCAPE_LOSS * bs, (text[:40], real, n, bs)
        assert real >= (n - overhead) // (routes._ESCAPE_LOSS + 1), (text[:40], real, n)


@pytest.mark.parametrize("text", ["words", "runs"])
def test_an_8_mb_prompt_without_escapes_is_refused_before_its_header_is_parsed(lm, text, monkeypatch):
    """With a 256-byte longest token, 8 MB of plain text at an 8K context is refused by its header's
    size alone (its few backslashes are the JSON's own quotes): ``unpack`` never runs."""
    from llm_svc.front import routes

    rng = random.Random(4)
    if text == "words":
        words = _words(20000, 1)
        body_text = " ".join(rng.choice(words) for _ in range(1_400_000))[:8_000_000]
    else:
        body_text = "".join(rng.choice("- =") * rng.randint(1, 700) for _ in range(30000))[:8_000_000]
    body = pack({}, _chat(body_text))
    monkeypatch.setattr(routes, "unpack", lambda *a: pytest.fail("the header was parsed"))
    with pytest.raises(InvalidRequest) as e:
        _prepare(lm, body, 8192)
    assert e.value.code == "context_length_exceeded" and "max_model_len=8192" in e.value.message


def test_a_prompt_of_escapes_goes_on_to_the_parse_and_the_token_bounds(lm, monkeypatch):
    """A control character takes 7 header bytes (``\\\\u0001``): a header of 21 KB of them holds
    3,000 text bytes, under the 16 KB that 64 tokens of 256 bytes may hold, so the header bound lets
    it through (with no slack, where bytes alone would refuse it) and the token bounds decide."""
    from llm_svc.front import routes

    monkeypatch.setattr(routes, "_HEADER_SLACK", 0)
    body = pack({}, _chat("\x01" * 3000, max_tokens=8))
    n, bs = _header_bytes_and_backslashes(body)
    assert n > lm.max_token_bytes * 64 and bs >= 6000
    with pytest.raises(InvalidRequest) as e:
        _prepare(lm, body, 64)
    assert not e.value.message.startswith("the request header"), e.value.message
    assert "max_model_len=64" in e.value.message
