"""How many tokens a prompt has at least, without tokenizing all of it.

A prompt that cannot fit ``max_model_len`` must be refused in milliseconds whatever its size.
``bytes / longest token`` is a lower bound, but a real vocabulary's longest token is a run of
hundreds of spaces or dashes, so 8 MB of text is only "at least 31,250 tokens" by it and would
be tokenized whole (seconds). ``tokens_past`` refuses sooner with two tighter bounds:

* ``TokenBound.at_least``: byte changes. Let ``D_p(s)`` count the positions ``i >= p`` of a byte
  string with ``s[i] != s[i-p]``. Cut a text ``W`` into its ``n`` tokens: a counted position
  either lies in the same token as ``i-p`` (counted in that token's ``D_p``) or among the first
  ``p`` bytes of its token, so ``D_p(W) <= n * (max over the vocabulary of D_p + p)``. A run of
  256 dashes has ``D_1 = 0``; words of ordinary text change at nearly every byte. It holds for any
  tokenization into the vocabulary, as long as the tokens' bytes are the text's bytes: a
  byte-level BPE without a normalizer or with NFC (applied here first); otherwise only the
  bytes bound is used. A few ms for 8 MB.
* ``chunked_at_least``: the tokenizer itself on chunks of the text, stopping once the running
  sum passes the budget, so the work is bounded by the budget, not by the prompt's size. The
  whole text has at least the chunks' sum less what the cuts added. A cut goes before a space
  between two non-space characters where one is near: every byte-level BPE's pre-tokenizer
  (GPT-2, Llama 3, Qwen, o200k) splits there and merges never cross a split, so the chunks'
  tokens are the whole text's (a tokenizer that prepends ``▁`` to every chunk adds one:
  ``SPACE_CUT_SLACK``). Where a 1 KB window has no such space the cut is hard (inside a word, a
  run or a special token) and changes the tokens next to it: at most 11 more in 1,200 random
  cuts of runs, glued words and special tokens on a 50k-token BPE, so each is charged
  ``HARD_CUT_SLACK = 24`` (``tests/unit/test_prompt_bound.py`` checks the sums).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

import numpy as np

PERIODS = (1, 2, 3, 4)  # D_p for runs of one byte and of 2-4 byte units ("\r\n", "ÃÂ", em dashes)
CHUNK_CHARS = 16384
CUT_WINDOW = 1024  # how far back from a chunk's end a space cut is looked for
SPACE_CUT_SLACK = 1
HARD_CUT_SLACK = 24
EAGER_CHARS_PER_TOKEN = 8  # a text this short for its budget is tokenized whole: no dearer than chunks


@dataclass(frozen=True)
class TokenBound:
    """What lower-bounds a text's tokens in one vocabulary, read once at load."""

    max_bytes: int  # longest token in UTF-8 bytes
    max_changes: tuple[int, ...] = ()  # per period p of PERIODS: the most D_p of one token; (): unknown
    nfc: bool = False  # the tokenizer normalizes to NFC first

    def __post_init__(self) -> None:
        assert self.max_bytes >= 1 and len(self.max_changes) in (0, len(PERIODS)), self

    @classmethod
    def of(cls, tokenizer) -> TokenBound:
        vocab = _token_bytes(tokenizer)
        if vocab is None:  # not byte-level: each entry's own text, an upper bound on its bytes in text
            return cls(max_bytes=max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()), default=1))
        nfc = type(tokenizer.backend_tokenizer.normalizer).__name__ == "NFC"
        return cls(max_bytes=max(map(len, vocab), default=1), max_changes=_max_changes(vocab), nfc=nfc)

    def at_least(self, text: str) -> int:
        """A lower bound on the tokens of ``text`` (any tokenization of it into this vocabulary)."""
        if self.nfc and not text.isascii():
            text = unicodedata.normalize("NFC", text)
        data = text.encode("utf-8", "replace")
        n = -(-len(data) // self.max_bytes)
        if self.max_changes and len(data) > 1:
            a = np.frombuffer(data, np.uint8)
            for p, most in zip(PERIODS, self.max_changes):
                if len(a) > p:
                    changes = int(np.count_nonzero(a[p:] != a[:-p]))
                    n = max(n, -(-changes // (most + p)))
        return n


def tokens_past(tokenizer, bound: TokenBound, text: str, budget: int, add_special_tokens: bool = False) -> int | None:
    """A lower bound on the tokens of ``text`` once it exceeds ``budget``, else None (the text may
    fit: tokenize it whole for the exact count)."""
    n = bound.at_least(text)
    if n <= budget and len(text) > EAGER_CHARS_PER_TOKEN * max(budget, 1):
        n = chunked_at_least(tokenizer, text, budget, add_special_tokens)
    return n if n > budget else None


def chunked_at_least(tokenizer, text: str, budget: int, add_special_tokens: bool = False) -> int:
    """A lower bound on the tokens of ``text`` from its chunks' counts, returned as soon as it
    exceeds ``budget`` (the module's docstring says why it is one)."""
    total, slack, start = 0, 0, 0
    while start < len(text) and total - slack <= budget:
        end, hard = _cut(text, start, start + CHUNK_CHARS)
        total += len(tokenizer(text[start:end], add_special_tokens=add_special_tokens and start == 0)["input_ids"])
        if end < len(text):
            slack += HARD_CUT_SLACK if hard else SPACE_CUT_SLACK
        start = end
    return total - slack


def _cut(text: str, start: int, pos: int) -> tuple[int, bool]:
    """Where the chunk from ``start`` ending near ``pos`` ends, and whether the cut is hard (not
    before a space between two non-space characters)."""
    if pos >= len(text):
        return len(text), False
    lo = max(pos - CUT_WINDOW, start + 1)
    i = text.rfind(" ", lo, pos)
    while i > 0:
        if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            return i, False
        i = text.rfind(" ", lo, i)
    return pos, True


def _token_bytes(tokenizer) -> list[bytes] | None:
    """Every vocabulary entry's bytes as they occur in text, for a byte-level BPE whose
    normalizer is none or NFC; None for any other tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if backend.normalizer is not None and type(backend.normalizer).__name__ != "NFC":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    out = []
    for tok in tokenizer.get_vocab():
        if tok in added:
            out.append(tok.encode("utf-8"))
            continue
        try:
            out.append(bytes(byte_of[c] for c in tok))
        except KeyError:  # not a byte-level entry after all
            return None
    return out


def _max_changes(tokens: list[bytes]) -> tuple[int, ...]:
    """Per period p: the most positions i >= p of one token with ``t[i] != t[i-p]``."""
    lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
    buf = np.frombuffer(b"".join(tokens), np.uint8)
    owner = np.repeat(np.arange(len(tokens)), lens)  # [bytes] token of each byte
    offset = np.arange(len(buf)) - np.repeat(np.cumsum(lens) - lens, lens)  # [bytes] position in its token
    out = []
    for p in PERIODS:
        changed = np.zeros(len(buf), bool)
        changed[p:] = buf[p:] != buf[:-p]
        changed &= offset >= p
        out.append(int(np.bincount(owner[changed], minlength=len(tokens)).max(initial=0)))
    return tuple(out)
