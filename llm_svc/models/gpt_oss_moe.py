"""gpt-oss' routed experts kept MXFP4-packed on the CPU (``PackedGptOssExperts``), in place of
transformers' ``GptOssExperts`` (same call: ``experts(x [T, H], router_indices [T, K],
routing_weights [T, K]) -> [T, H]``).

The published checkpoints store each expert's ``gate_up`` ``[2I, H]`` (gate and up rows
interleaved: gate = even columns of the product, up = odd) and ``down`` ``[H, I]`` as MXFP4
blocks + E8M0 scales (``quant.Mxfp4``). Each is packed as read, one expert at a time
(``qweight.pack("mxfp4", ...)``), so the float experts never exist; a decode step streams 0.53
bytes a weight. The fused MoE kernel (``cpu_packed.moe_w``) computes a plain SiLU gate without
biases, so the experts run here per expert through the packed GEMM (``cpu_packed.gemm``): the
routed (token, expert) pairs grouped by expert, ``gate_up`` + bias, the clamped SwiGLU in
torch, ``down`` + bias, weighted by the router's score and summed into each token's row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import cpu_packed, qweight

GATE_UP, DOWN = "gate_up_proj", "down_proj"


def mxfp4_experts_pack_here(device: str | torch.device = "cpu") -> bool:
    """Whether gpt-oss' MXFP4 experts stay packed: a CPU model and the kernel's MXFP4 build built here."""
    return torch.device(device).type == "cpu" and qweight.kernel("mxfp4") is not None


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers ``GptOssExperts._apply_gate``: ``gate_up [..., 2I]`` (gate, up interleaved) -> [..., I]."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class PackedGptOssExperts(nn.Module):
    """Every expert of one gpt-oss MoE layer: packed weights (``gate_up[e]`` n = 2I, k = H;
    ``down[e]`` n = H, k = I), float biases as parameters (``gate_up_proj_bias [E, 2I]``,
    ``down_proj_bias [E, H]``). ``state_dict`` also gives the dequantized weights in
    transformers' layout (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, in
    ``weight_dtype``), so a packed model's state dict is the dequantized model's."""

    def __init__(self, num_experts: int, hidden: int, inter: int, alpha: float = 1.702, limit: float = 7.0,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, inter
        self.alpha, self.limit = alpha, limit
        self.weight_dtype = weight_dtype
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.packed: dict[str, list[qweight.PackedWeight]] = {}
        self._register_state_dict_hook(_dense_state)

    @classmethod
    def like(cls, experts: nn.Module, weight_dtype: torch.dtype) -> PackedGptOssExperts:
        """One in place of transformers' ``GptOssExperts`` ``experts`` (its sizes and gate constants)."""
        return cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, float(experts.alpha),
                   float(experts.limit), weight_dtype)

    def set_packed(self, name: str, blocks: torch.Tensor, scales: torch.Tensor | None = None,
                   expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None, kernels=None) -> None:
        """Pack ``name``'s (``GATE_UP`` / ``DOWN``) stored blocks ``[E, N, K / 32, 16]`` and scales
        ``[E, N, K / 32]``, one expert at a time (for ``kernels``' MXFP4 build: default
        ``cpu_packed.KERNELS``). ``expert(e)``: expert e's (blocks, scales) read on demand, where
        ``blocks`` (then maybe a meta tensor) only gives the shape."""
        want = {GATE_UP: (2 * self.intermediate_size, self.hidden_size),
                DOWN: (self.hidden_size, self.intermediate_size)}[name]
        e, n, g = self.num_experts, *want
        if blocks.dim() != 4 or tuple(blocks.shape[:3]) != (e, n, g // 32):
            raise ValueError(f"has shape {list(blocks.shape)}, the config implies [{e}, {n}, {g // 32}, 16]")
        get = expert or (lambda i: (blocks[i], scales[i]))
        self.packed[name] = [qweight.pack("mxfp4", *get(i), kernels=kernels) for i in range(e)]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights (the biases are parameters)."""
        return sum(p.nbytes for ps in self.packed.values() for p in ps)

    def dense(self, name: str) -> torch.Tensor:
        """The float32 weights of ``name`` in transformers' layout: ``[E, in, out]``."""
        return torch.stack([qweight.dense(p).t() for p in self.packed[name]])

    def forward(self, x: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        t, k = router_indices.shape  # x [T, H], router_indices / routing_weights [T, K]
        xf = x.float() if x.dtype not in cpu_packed.ACT_DTYPES else x
        out = torch.zeros(t, self.hidden_size, dtype=torch.float32)
        flat = router_indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        if len(counts) > self.num_experts:
            raise ValueError(f"routed experts: an expert index outside [0, {self.num_experts})")
        scores = routing_weights.reshape(-1).float()
        gu_bias, d_bias = self.gate_up_proj_bias.float(), self.down_proj_bias.float()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tok = pairs // k
            gu = cpu_packed.gemm(xf.index_select(0, tok), self.packed[GATE_UP][e], gu_bias[e]).float()  # [n, 2I]
            act = clamped_swiglu(gu, self.alpha, self.limit)  # [n, I]
            y = cpu_packed.gemm(act, self.packed[DOWN][e], d_bias[e])  # [n, H]
            out.index_add_(0, tok, y * scores[pairs, None])
        return out.to(x.dtype)


def _dense_state(module: PackedGptOssExperts, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in module.packed:
        state_dict[prefix + name] = module.dense(name).to(module.weight_dtype)
