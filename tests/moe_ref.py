"""The routed-experts reference the CPU MoE kernels' tests compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(x, idx, w, gate_up, down) -> torch.Tensor:
    """sum over k of w * down[e] . (silu(gate[e] . x) * (up[e] . x)), in float64: ``x [T, H]``,
    ``idx`` / ``w [T, K]``, ``gate_up [E, 2I, H]`` (gate rows first), ``down [E, H, I]``."""
    i = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gu = gate_up[e].double() @ x[t].double()
            out[t] += float(w[t, k]) * (down[e].double() @ (F.silu(gu[:i]) * gu[i:]))
    return out
