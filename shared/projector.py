"""The media projector of mmserve bundles: encoder features -> LM hidden size.

``PoolProjector`` average-pools the encoder's token sequence, then maps it with
``LayerNorm -> Linear -> GELU -> Linear``. ``pool="grid2d"`` pools a square patch grid to a
square of ``tokens`` (vision); ``pool="seq1d"`` pools a sequence by ``stride`` (audio).
Stored as ``projector.json`` (the ``ProjectorConfig``) + ``projector.safetensors``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass(frozen=True)
class ProjectorConfig:
    in_dim: int
    out_dim: int
    pool: str  # "grid2d" | "seq1d"
    tokens: int = 0  # grid2d: output tokens (a square number)
    stride: int = 1  # seq1d: input frames per output token

    def __post_init__(self) -> None:
        if self.pool == "grid2d":
            side = math.isqrt(self.tokens)
            if self.tokens < 1 or side * side != self.tokens:
                raise ValueError(f"grid2d pooling needs a square token count, got {self.tokens}")
        elif self.pool == "seq1d":
            if self.stride < 1:
                raise ValueError("seq1d pooling needs stride >= 1")
        else:
            raise ValueError(f"unknown pool {self.pool!r}")


class PoolProjector(nn.Module):
    def __init__(self, cfg: ProjectorConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = nn.LayerNorm(cfg.in_dim)
        self.fc1 = nn.Linear(cfg.in_dim, cfg.out_dim)
        self.fc2 = nn.Linear(cfg.out_dim, cfg.out_dim)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, Din]
        b, n, d = x.shape
        if self.cfg.pool == "grid2d":
            side = math.isqrt(n)
            assert side * side == n, f"patch count {n} is not a square grid"
            out = math.isqrt(self.cfg.tokens)
            grid = x.transpose(1, 2).reshape(b, d, side, side)  # [B, D, S, S]
            pooled = F.adaptive_avg_pool2d(grid, out)  # [B, D, out, out]
            return pooled.flatten(2).transpose(1, 2)  # [B, T, D]
        s = self.cfg.stride
        t = math.ceil(n / s)
        return F.avg_pool1d(x.transpose(1, 2), s, s, ceil_mode=True).transpose(1, 2)[:, :t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, Din] -> [B, T, Dout]
        h = self.norm(self.pool(x))
        return self.fc2(F.gelu(self.fc1(h)))

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "projector.json").write_text(json.dumps(asdict(self.cfg), indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(d / "projector.safetensors"))

    @classmethod
    def load(cls, directory: str | Path) -> "PoolProjector":
        d = Path(directory)
        cfg = ProjectorConfig(**json.loads((d / "projector.json").read_text()))
        module = cls(cfg)
        module.load_state_dict(load_file(str(d / "projector.safetensors")))
        return module.eval()
