"""N-gram prompt lookup: drafts copied from what followed an earlier occurrence of the context's
last tokens. No model; it runs for every speculating request every step.

The semantics are vLLM 0.32's (``vllm/v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens``, a KMP over the reversed context), which
come down to:
- no drafts when the context is shorter than ``min_n``, or when it already holds
  ``max_model_len`` tokens; at most ``max_model_len - len(context)`` drafts;
- n = the longest length in [1, max_n] whose last-n-tokens occur earlier in the context, ending
  before its last token (an occurrence may overlap the suffix itself); none when that n < min_n
  (a shorter n is never tried instead: n is the longest match, min_n only a floor);
- of that n-gram's occurrences, the EARLIEST one;
- the drafts: the up to k tokens that follow it (fewer when the context ends sooner).

vLLM's scheduler then trims what it verifies so that every position fits: 1 + drafts <=
max_model_len - (len(context) - 1), i.e. at most ``max_model_len - len(context) - 1`` drafts
(the token after the last draft must fit too). That is the caller's ``max_new`` here, with
whatever ``max_tokens`` leaves; vLLM also drafts nothing for a request whose last step sampled
no token (a prefill chunk short of the prompt's end).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """``propose(tokens)`` -> up to ``k`` drafts by prompt lookup with n-gram lengths in
    [``min_n``, ``max_n``]. ``max_model_len`` (optional) caps ``len(tokens) + len(drafts)``,
    as vLLM's proposer does."""

    def __init__(self, min_n: int, max_n: int, k: int, max_model_len: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.max_model_len = max_model_len

    def propose(self, tokens: Sequence[int] | np.ndarray, max_new: int | None = None) -> list[int]:
        """``tokens``: the whole context (prompt and outputs so far, the last sampled token
        included). ``max_new``: a further cap on the number of drafts (what ``max_tokens``
        leaves). Returns the drafts, possibly none."""
        t = np.asarray(tokens)
        total = t.shape[0]
        k = self.k if max_new is None else min(self.k, max_new)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - total)
        if total < self.min_n or k <= 0 or total < 2:
            return []
        n, end = longest_earliest_match(t, self.max_n)
        if n < self.min_n:
            return []
        return t[end:end + k].tolist()


def longest_earliest_match(t: np.ndarray, max_n: int) -> tuple[int, int]:
    """t [N] tokens -> (n, e): n = the longest length <= max_n such that t[e-n:e] == t[N-n:]
    for some e <= N-1, and e the smallest such end; (0, 0) when the last token never occurred
    before. Candidate ends are narrowed one length at a time (the ends that match n + 1 tokens
    are among those that match n): as a dense mask over the context while many remain (a
    repetitive context), then as a list of positions; O(N * levels) at worst, O(N) typically."""
    total = t.shape[0]
    # m[p]: the window ending at e = p + 1 matches the last n tokens; p in [0, N-2]
    m = t[:total - 1] == t[total - 1]
    n = 1
    while n < max_n and np.count_nonzero(m) * 8 > total:
        nxt = np.zeros_like(m)
        nxt[n:] = m[n:] & (t[:total - 1 - n] == t[total - 1 - n])
        if not nxt.any():
            break
        m, n = nxt, n + 1
    cand = np.flatnonzero(m)
    if cand.shape[0] == 0:
        return 0, 0
    while n < max_n:
        nxt = cand[cand >= n]  # room for one more token before the window
        nxt = nxt[t[nxt - n] == t[total - 1 - n]]
        if nxt.shape[0] == 0:
            break
        cand, n = nxt, n + 1
    return n, int(cand[0]) + 1
