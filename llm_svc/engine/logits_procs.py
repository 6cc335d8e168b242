"""Logits processors of the OpenAI / vLLM sampling knobs, batched on the logits' device.

Order (vLLM v1's sampler): ``logit_bias`` is added, then the penalties, then (inside
``sampler.sample``, after the temperature) ``min_p``. Penalties follow vLLM exactly:
``repetition_penalty`` r divides a positive logit by r and multiplies a negative one by r for
every token seen in the prompt or the output so far; ``frequency_penalty`` subtracts
``f * count`` and ``presence_penalty`` subtracts ``p`` for every token in the output so far.
Logprobs are taken from the raw logits, before any of this (vLLM's default ``raw_logprobs``).

Each penalised request keeps a ``TokenHistory`` (output counts and the prompt's token set, one
``[V]`` vector each on the logits' device) updated with every token it emits, so a step costs
O(rows * V) tensor work, never a walk over the request's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.schemas import SamplingParams


def penalised(sp: SamplingParams) -> bool:
    return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0


@dataclass
class TokenHistory:
    """What a penalty needs of one request: ``counts [V]`` float32 of its output tokens, and
    ``seen [V]`` bool: in the prompt or the output."""

    counts: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def start(cls, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int,
              device: torch.device) -> "TokenHistory":
        counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if output_ids:
            counts.index_add_(0, torch.tensor(list(output_ids), device=device),
                              torch.ones(len(output_ids), device=device))
        seen = counts > 0
        if prompt_ids:
            seen[torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long, device=device)] = True
        return cls(counts, seen)

    def plus(self, token_id: int) -> "TokenHistory":
        """A copy with ``token_id`` added (the state at the next draft position)."""
        h = TokenHistory(self.counts.clone(), self.seen.clone())
        h.add(token_id)
        return h

    def add(self, token_id: int) -> None:
        if 0 <= token_id < self.counts.shape[0]:
            self.counts[token_id] += 1.0
            self.seen[token_id] = True


def apply_bias_and_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                             histories: Sequence[TokenHistory | None]) -> torch.Tensor:
    """logits [B, V] -> a new tensor with each row's ``logit_bias`` added and its penalties
    applied (``histories[row]`` is set for every penalised row); ``logits`` is not changed.
    Rows with neither are left as they are (no work at all when no row has one)."""
    biased = [r for r, sp in enumerate(params) if sp.logit_bias]
    pen = [r for r, sp in enumerate(params) if penalised(sp)]
    if not biased and not pen:
        return logits
    out = logits.float().clone()
    dev = out.device
    if biased:
        rows = [r for r in biased for _ in params[r].logit_bias]
        cols = [int(t) for r in biased for t in params[r].logit_bias]
        vals = [float(b) for r in biased for b in params[r].logit_bias.values()]
        out.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                       torch.tensor(vals, device=dev), accumulate=True)
    if pen:
        idx = torch.tensor(pen, device=dev)
        x = out.index_select(0, idx)  # [R, V]
        counts = torch.stack([histories[r].counts for r in pen])  # [R, V]
        seen = torch.stack([histories[r].seen for r in pen])
        rep = torch.tensor([params[r].repetition_penalty for r in pen], device=dev)[:, None]  # [R, 1]
        r_eff = torch.where(seen, rep, torch.ones_like(rep))  # [R, V]
        x = torch.where(x > 0, x / r_eff, x * r_eff)
        freq = torch.tensor([params[r].frequency_penalty for r in pen], device=dev)[:, None]
        pres = torch.tensor([params[r].presence_penalty for r in pen], device=dev)[:, None]
        x = x - freq * counts - pres * (counts > 0).float()
        out.index_copy_(0, idx, x)
    return out.to(logits.dtype)


def top_logprobs(raw: torch.Tensor, chosen: Sequence[int], ks: Sequence[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """raw [R, V] logits of the rows that want logprobs, ``chosen[r]`` the token each emitted,
    ``ks[r]`` how many alternatives (0..20) -> per row (logprob of the chosen token,
    [(token id, logprob)] of its top ``ks[r]``, most likely first)."""
    lp = torch.log_softmax(raw.float(), dim=-1)  # [R, V]
    mine = lp.gather(1, torch.tensor(list(chosen), device=lp.device)[:, None])[:, 0].tolist()
    kmax = max(ks) if ks else 0
    tops: list[list[tuple[int, float]]] = [[] for _ in ks]
    if kmax > 0:
        vals, ids = lp.topk(min(kmax, lp.shape[1]), dim=-1)  # [R, kmax], not a sort of the vocabulary
        vals, ids = vals.tolist(), ids.tolist()
        tops = [list(zip(ids[r][:k], vals[r][:k])) for r, k in enumerate(ks)]
    return list(zip(mine, tops))
