"""The word cache of a fast tokenizer, bounded for a long-running service.

HF ``tokenizers`` BPE and Unigram models remember the pieces of every distinct word they split,
up to 10,000 words per tokenizer (~235 B each with the tiny model's BPE, native memory that
``tracemalloc`` does not see), and never evict: a service whose prompts keep bringing new words
(ids, numbers, names) grows by ~2.3 MB per tokenizer copy until that fills, tens of thousands of
requests in. ``bound_word_cache`` caps it far lower, so it fills in the first few thousand
requests; the words cached first (system prompts, common words) are the ones that repeat.
"""

from __future__ import annotations

WORD_CACHE_WORDS = 2048


def bound_word_cache(tokenizer, words: int = WORD_CACHE_WORDS) -> bool:
    """Cap the word cache of ``tokenizer``'s model (a private ``tokenizers`` call, hence the
    checks); False if it has none (a slow tokenizer, WordPiece, WordLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    resize = getattr(getattr(backend, "model", None), "_resize_cache", None)
    if resize is None:
        return False
    resize(words)
    return True
