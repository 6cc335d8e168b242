"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's log-probability given the
tokens before it, under the raw model (before any bias, penalty or grammar, as vLLM's default),
with its rank in the vocabulary and its position's most likely alternatives.

Row p of a prefill's logits scores prompt token p + 1; position 0 has no score. A request
scores its prompt chunk by chunk (the scheduler asks the runner for every row of such a chunk:
``SeqForward.all_logits``), so chunk i's last row scores chunk i + 1's first token.
``PromptScores`` keeps each position once, whatever the chunking, and skips what it already
has when a preempted request recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_svc.types.messages import CorePromptLogprob

_BLOCK_ROWS = 64  # rows per log-softmax: bounds the float32 [rows, vocab] copies of a long chunk


def score_rows(rows: torch.Tensor, targets: Sequence[int], k: int) -> list[CorePromptLogprob]:
    """rows [n, V] logits, ``targets[i]`` the token row i scores -> per row its logprob, its rank
    (vLLM's: the tokens at least as likely, itself included) and the top ``k`` (id, logprob)."""
    assert rows.dim() == 2 and rows.shape[0] == len(targets), (rows.shape, len(targets))
    out: list[CorePromptLogprob] = []
    for a in range(0, rows.shape[0], _BLOCK_ROWS):
        lp = torch.log_softmax(rows[a:a + _BLOCK_ROWS].float(), dim=-1)  # [b, V]
        tgt = torch.tensor(list(targets[a:a + _BLOCK_ROWS]), dtype=torch.long, device=lp.device)[:, None]  # [b, 1]
        mine = lp.gather(1, tgt)  # [b, 1]
        ranks = (lp >= mine).sum(dim=-1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in ranks]
        if k > 0:
            vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)  # [b, k]
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        out.extend(CorePromptLogprob(lp_, r, t) for lp_, r, t in zip(mine[:, 0].tolist(), ranks, tops))
    return out


class PromptScores:
    """One request's prompt logprobs so far: ``entries[p]`` for positions 0..len-1 (position 0's
    entry, without a logprob, is there from the start)."""

    def __init__(self, prompt_ids: Sequence[int], k: int) -> None:
        self.prompt_ids = prompt_ids
        self.k = k
        self.entries: list[CorePromptLogprob] = [CorePromptLogprob()]

    @property
    def complete(self) -> bool:
        return len(self.entries) == len(self.prompt_ids)

    def add(self, rows: torch.Tensor, start: int) -> None:
        """rows [n, V]: the logits of positions ``start..start+n-1``; scores the prompt positions
        they reach that are not scored yet. Raises if they would leave a gap (a chunk that starts
        past the next unscored position's row: a cached prefix the scheduler should not allow)."""
        lo = len(self.entries)  # the next position to score
        hi = min(start + rows.shape[0], len(self.prompt_ids) - 1)  # the last position these rows reach
        if hi < lo:
            return
        if start > lo - 1:
            raise RuntimeError(f"prompt logprobs: rows from position {start} cannot score position {lo}")
        self.entries.extend(score_rows(rows[lo - 1 - start:hi - start], self.prompt_ids[lo:hi + 1], self.k))
