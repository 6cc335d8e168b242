"""The batch items of one audio clip: the type every audio tower's ``prepare`` returns
(at the bottom of ``encoder_svc.models`` so towers and the registry both import it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AudioItems:
    """A clip's batch items, in order: ``groups`` of equal-shape items ``[K_g, *item]`` (one
    batcher job each) and ``tokens[k]``, the output rows of item k (counted across groups) to keep."""

    groups: list[torch.Tensor]
    tokens: list[int]

    def __post_init__(self) -> None:
        assert sum(len(g) for g in self.groups) == len(self.tokens) and min(self.tokens) >= 1, self.tokens

    def kept(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' outputs ``[K_g, rows, H]`` -> the clip's embeddings ``[sum(tokens), H]``."""
        rows = [o[k] for o in outs for k in range(len(o))]
        assert len(rows) == len(self.tokens), (len(rows), len(self.tokens))
        return torch.cat([r[:n] for r, n in zip(rows, self.tokens)])
