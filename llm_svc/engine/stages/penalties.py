"""``logit_bias`` and the repetition / frequency / presence penalties of a step's rows.

Per request: its ``TokenHistory`` (penalised requests only), started at its first sampled or
verified row from the tokens it has then, grown by each token it emits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_svc.engine.live import Live
from llm_svc.engine.logits_procs import TokenHistory, apply_bias_and_penalties, penalised
from llm_svc.types.request import Request
from shared.schemas import SamplingParams


class Penalties:
    @staticmethod
    def start(lv: Live, req: Request, vocab: int, device: torch.device) -> None:
        """``req`` (the scheduler's view of ``lv``) gets its history if it is penalised and has none."""
        if lv.history is None and penalised(lv.req.sampling):
            lv.history = TokenHistory.start(req.prompt_ids, req.output_ids, vocab, device)

    @staticmethod
    def apply(rows: torch.Tensor, params: Sequence[SamplingParams], lives: Sequence[Live]) -> torch.Tensor:
        """rows [N, V] -> biased and penalised rows (``rows`` itself when no row has either)."""
        return apply_bias_and_penalties(rows, params, [lv.history for lv in lives])

    @staticmethod
    def emitted(lv: Live, token_id: int | None) -> None:
        if lv.history is not None and token_id is not None:
            lv.history.add(token_id)

    @staticmethod
    def release(lv: Live) -> None:
        lv.history = None
