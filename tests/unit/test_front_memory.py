"""Issue 11 item 7, the LLM front: what a request leaves behind in the front's prep path (the
body unpacked and the prompt tokenized on the ``PrepPool`` threads) stops growing.

The growth found in the soak was native, out of ``tracemalloc``'s sight: each prep thread's
tokenizer copy kept every distinct word it split, up to 10,000 (~235 B each), filling over the
first ~20,000 requests. Counted here in requests and words, measured as glibc's bytes in use
(``mallinfo2``), never timed: past the bound, thousands of new words add (almost) nothing."""

from __future__ import annotations

import asyncio
import copy
import ctypes
import gc

import pytest

from llm_svc.loading.loader import load_lm
from llm_svc.front.routes import _prepare
from llm_svc.front.state import PrepPool
from llm_svc.front.word_cache import WORD_CACHE_WORDS, bound_word_cache
from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from shared.wire import pack

WORDS_PER_REQUEST = 20
BYTES_PER_WORD = 235  # what one cached word holds with the tiny BPE (probe: 4.7 MB per 20,000)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def malloc_in_use() -> int:
    gc.collect()
    m = LIBC.mallinfo2()
    return m.uordblks + m.hblkhd


@pytest.fixture(scope="module")
def lm(mimo_bundle):
    return load_lm(str(mimo_bundle), weights=False)


def bodies(start: int, n: int) -> list[bytes]:
    """Requests as the gateway sends them, each with new words (numbers, as the soak's prompts)."""
    out = []
    for r in range(start, start + n):
        words = " ".join(str(100_000 + r * WORDS_PER_REQUEST + k) for k in range(WORDS_PER_REQUEST))
        req = GenerateRequest(request_id=f"req-{r}", messages=[PromptMessage(role="user", content=[
            PromptText(text=f"red cat {words} blue sky")])], sampling=SamplingParams(max_tokens=4))
        out.append(pack({}, req))
    return out


def serve(pool: PrepPool, batch: list[bytes]) -> None:
    async def run() -> None:
        for body in batch:
            await pool.run(_prepare, body, 4096)

    asyncio.run(run())


@pytest.mark.skipif(LIBC is None, reason="needs glibc's mallinfo2")
def test_new_words_stop_costing_memory_past_the_bound(lm):
    pool = PrepPool(lm, workers=1)
    try:
        # warm-up: the thread's tokenizer copy exists and its bounded cache is full
        serve(pool, bodies(0, 2 * WORD_CACHE_WORDS // WORDS_PER_REQUEST))
        before = malloc_in_use()
        n = 300  # 6,000 more new words: the library's own 10,000-word cache would keep them all
        serve(pool, bodies(10_000, n))
        grown = malloc_in_use() - before
    finally:
        pool.close()
    unbounded = n * WORDS_PER_REQUEST * BYTES_PER_WORD  # ~1.4 MB
    assert grown < unbounded // 4, f"{n} requests of new words kept {grown} B (~{grown // n} B per request)"


def test_a_bounded_tokenizer_splits_the_same(lm):
    bounded = copy.deepcopy(lm.tokenizer)
    assert bound_word_cache(bounded)
    texts = [f"the cat {i} sat on {i * 7} red mats, hello world" for i in range(50)]
    for text in texts * 2:  # the second round is served from the cache
        assert bounded(text)["input_ids"] == lm.tokenizer(text)["input_ids"]


def test_a_tokenizer_without_a_word_cache_is_left_alone():
    class Slow:  # a slow (pure Python) tokenizer has no backend_tokenizer
        pass

    assert not bound_word_cache(Slow())


@pytest.mark.skipif(LIBC is None, reason="needs glibc's mallinfo2")
def test_word_cache_setting_sets_the_bound(lm):
    """``tokenizer_word_cache`` reaches each prep thread's copy: with 0, new words cost nothing
    from the first request (the soak sets a small bound so the cache is full before it measures)."""
    pool = PrepPool(lm, workers=1, word_cache=0)
    try:
        serve(pool, bodies(0, 10))  # the thread and its tokenizer copy exist
        before = malloc_in_use()
        n = 100  # 2,000 new words: ~470 KB with the default bound
        serve(pool, bodies(20_000, n))
        grown = malloc_in_use() - before
    finally:
        pool.close()
    assert grown < n * WORDS_PER_REQUEST * BYTES_PER_WORD // 4, f"{n} requests kept {grown} B"


def test_service_state_passes_the_word_cache_setting(mimo_bundle):
    from shared.settings import LLMSettings

    assert LLMSettings(model_dir=str(mimo_bundle)).tokenizer_word_cache == WORD_CACHE_WORDS
    assert LLMSettings(model_dir=str(mimo_bundle), tokenizer_word_cache=16).tokenizer_word_cache == 16
