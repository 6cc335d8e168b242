"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from shared.schemas import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A request's own RNG (seeded if it asked for a seed); None for greedy requests."""
    if params.temperature == 0.0:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with everything outside top-k / the top-p nucleus at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] float32 -> one token per row. Greedy rows take the argmax (ties: lowest id)."""
    assert logits.shape[0] == len(params) == len(generators)
    out = logits.argmax(dim=-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.temperature == 0.0:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, -1)
        out[i] = int(torch.multinomial(probs, 1, generator=g))
    return out
