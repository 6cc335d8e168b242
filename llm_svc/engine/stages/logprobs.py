"""Logprobs in a step: of the sampled or verified tokens (``return_logprobs``, from the raw
model's rows) and of the prompt (``prompt_logprobs``: scored chunk by chunk during prefill,
sent with the request's first output).

Per request: its ``PromptScores`` (requests asking for prompt logprobs), started at ``add``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_svc.engine.live import Live
from llm_svc.engine.logits_procs import top_logprobs
from llm_svc.engine.prompt_logprobs import PromptScores
from llm_svc.types.messages import CorePromptLogprob

Scored = tuple[float, list[tuple[int, float]]]  # one token's logprob and its top alternatives


class Logprobs:
    def __init__(self, live: dict[str, Live]):
        self.live = live

    @staticmethod
    def start(lv: Live) -> None:
        k = lv.req.sampling.prompt_logprobs
        lv.prompt = PromptScores(lv.req.prompt_ids, k) if k is not None else None

    @staticmethod
    def release(lv: Live) -> None:
        lv.prompt = None

    def score_prompts(self, batch, logits: dict[str, torch.Tensor]) -> None:
        """The prompt rows of ``all_logits`` seqs go to their requests' ``PromptScores``; ``logits``
        keeps only the last row of each (the one to sample from, when it has ``need_logits``)."""
        for sf in batch.seqs:
            if not sf.all_logits:
                continue
            rows = logits.pop(sf.req_id)  # [n, vocab]
            lv = self.live.get(sf.req_id)
            if lv is not None and lv.prompt is not None:
                lv.prompt.add(rows, sf.start)
            if sf.need_logits:
                logits[sf.req_id] = rows[-1]

    @staticmethod
    def sampled(rows: torch.Tensor, ids: Sequence[str], lives: Sequence[Live],
                tokens: Sequence[int]) -> dict[str, list[Scored]]:
        """rows [N, V] raw, ``tokens[n]`` sampled from row n -> per request asking for them, its
        token's logprobs (a list of one)."""
        want = [n for n, lv in enumerate(lives) if lv.req.return_logprobs]
        if not want:
            return {}
        sel = torch.tensor(want, device=rows.device)
        got = top_logprobs(rows.index_select(0, sel), [tokens[n] for n in want],
                           [lives[n].req.top_logprobs for n in want])
        return {ids[n]: [v] for n, v in zip(want, got)}

    @staticmethod
    def verified(lv: Live, rows: torch.Tensor, toks: list[int]) -> list[Scored] | None:
        """rows [d + 1, V] raw of one verifying request, ``toks`` the ones it kept -> their
        logprobs in order, if it asks for them."""
        if not lv.req.return_logprobs:
            return None
        return top_logprobs(rows[:len(toks)], toks, [lv.req.top_logprobs] * len(toks))

    @staticmethod
    def take_prompt(lv: Live, req_id: str) -> list[CorePromptLogprob] | None:
        """At a request's first output: its prompt logprobs (then gone from its record)."""
        if lv.prompt is None:
            return None
        assert lv.prompt.complete, f"{req_id}: prompt logprobs incomplete at its first output"
        prompt, lv.prompt = lv.prompt.entries, None
        return prompt
