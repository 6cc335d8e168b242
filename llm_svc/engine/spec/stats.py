"""Speculative-decoding counters with vLLM 0.32's meanings (``vllm/v1/spec_decode/metrics.py``,
``SpecDecodingStats`` / ``SpecDecodingLogging``):
- a draft: one request's proposal verified in one step (only proposals of >= 1 token count);
- num_draft_tokens / num_accepted_tokens: the tokens proposed / kept (the recovered or bonus
  token that follows is never counted as accepted);
- per position j (0-based): how many drafts had a token at j, and how many kept it;
- acceptance rate: accepted / drafted tokens; per-position acceptance rate: accepted at j /
  num_drafts (vLLM divides by the drafts, not by the drafts that reached j);
- mean acceptance length: 1 + accepted / drafts (the 1 is the token every step emits).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Running totals since start-up for drafts of at most ``num_spec_tokens`` tokens."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {self.num_spec_tokens}")
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_spec_tokens
        self.drafted_per_pos = self.drafted_per_pos or [0] * self.num_spec_tokens
        assert len(self.accepted_per_pos) == len(self.drafted_per_pos) == self.num_spec_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One request's step: ``num_drafted`` tokens proposed, the first ``num_accepted`` kept.
        A step with no drafts is not a draft (vLLM counts none) and changes nothing."""
        if not 0 <= num_accepted <= num_drafted <= self.num_spec_tokens:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafted ({num_drafted}) "
                             f"<= num_spec_tokens ({self.num_spec_tokens})")
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        for j in range(num_drafted):
            self.drafted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (tokens emitted per verified draft); None before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate_per_pos(self) -> list[float] | None:
        """Accepted at position j / num_drafts, for each j; None before any draft."""
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else None

    def as_dict(self) -> dict:
        """Counters and derived rates (None where there is no draft yet), for /metrics."""
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "num_draft_tokens_per_pos": list(self.drafted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "mean_acceptance_length": self.mean_acceptance_length,
        }
