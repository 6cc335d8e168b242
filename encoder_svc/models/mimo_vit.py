"""The MiMo-V2.5 vision tower (our implementation), read from the omni checkpoint's ``visual.``.

Structure as vLLM 0.32's ``MiMoVisionTransformer`` (``model_executor/models/mimo_v2_omni.py``),
which differs from Qwen2.5-VL's tower (GQA with ``qk_channels`` head dim, token-band windows with
sinks instead of spatial windows, RMSNorm merger):

    patches [N, 3*tp*ps*ps] --Conv3d(k = stride = (tp, ps, ps), no bias)--> [N, D]
    per block i: x += proj(attn(norm1(x))); x += down(silu(gate(norm2 x)) * up(norm2 x))
        attn: fused qkv (biased), GQA ``num_heads`` / ``num_key_value_heads``, head dim
              ``qk_channels``; 2-D rope (h, w) over the whole head (neox halves, theta 10000,
              each axis ``qk/4`` frequencies); one sequence per temporal group (frame pair);
        ``i in fullatt_block_indexes``: full attention; else a band ``|i - j| <= W``
              (``visual_token_window_size``) over the sequence in its current order, and
              ``sinks[h]`` added to the logit of key 0 (vLLM: ``sinks_bias_key0=True``);
        ``vit_window_attn_types[i] == 1``: the sequence is in column order (merged units listed
              by column, rope tables permuted alike) while inside such a run of blocks.
    merger: RMSNorm(D) -> view(-1, m*m*D) -> Linear -> GELU(erf) -> Linear(out_hidden), no biases.

Input ``[B, lh, lw, m*m, 3*tp*ps*ps]`` (one temporal group per item, ``preprocess/mimo_vision``),
output ``[B, lh*lw, out_hidden]``: all items of a batch share the grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shared.bundle import CheckpointError

_KNOWN = {
    "depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "num_key_value_heads", "qk_channels",
    "kv_channels", "in_chans", "in_channels", "patch_size", "spatial_patch_size", "spatial_merge_size",
    "temporal_patch_size", "fullatt_block_indexes", "vit_window_attn_types", "visual_token_window_size",
    "use_sink", "out_hidden_size",
    # read by vLLM for token-count estimates / not used by the forward pass
    "tokens_per_second", "window_size", "num_query_groups", "initializer_range", "model_type", "torch_dtype",
    "dtype", "_name_or_path", "transformers_version",
}


@dataclass(frozen=True)
class MiMoViTConfig:
    depth: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    patch: int
    merge: int
    temporal_patch: int
    window: int
    window_types: tuple[int, ...]
    full_blocks: tuple[int, ...]
    use_sink: bool
    out_hidden: int
    in_channels: int = 3
    eps: float = 1e-6  # vLLM: getattr(vllm_config, "rms_norm_eps", 1e-6)

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads or self.head_dim % 4:
            raise ValueError("num_heads must be a multiple of num_key_value_heads and qk_channels of 4")
        if len(self.window_types) != self.depth or any(t not in (-1, 0, 1) for t in self.window_types):
            raise ValueError(f"vit_window_attn_types must give -1/0/1 for each of the {self.depth} blocks")
        if any(not 0 <= b < self.depth for b in self.full_blocks) or self.window < 0:
            raise ValueError("fullatt_block_indexes must name blocks, visual_token_window_size must be >= 0")

    @classmethod
    def from_config(cls, cfg: dict, path: str | Path) -> "MiMoViTConfig":
        vc = cfg.get("vision_config")
        if not isinstance(vc, dict):
            raise CheckpointError(f"{path}: field 'vision_config' is missing")
        unknown = sorted(set(vc) - _KNOWN)
        if unknown:
            raise CheckpointError(f"{path}: field 'vision_config.{unknown[0]}' is not understood by mmserve's "
                                  f"MiMo ViT (all unknown: {unknown})")

        def need(key: str, default=None):
            if key not in vc and default is None:
                raise CheckpointError(f"{path}: field 'vision_config.{key}' is missing")
            return vc.get(key, default)

        if need("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{path}: field 'vision_config.hidden_act' = {vc['hidden_act']!r}: only silu")
        qk, kv = int(need("qk_channels", 64)), int(need("kv_channels", 64))
        if qk != kv:  # vLLM splits k with kv_channels while its fused qkv sizes k with qk_channels
            raise CheckpointError(f"{path}: field 'vision_config.kv_channels' = {kv} differs from qk_channels = {qk}")
        if "spatial_patch_size" in vc and vc["spatial_patch_size"] != need("patch_size"):
            raise CheckpointError(f"{path}: field 'vision_config.spatial_patch_size' differs from patch_size")
        depth = int(need("depth"))
        try:
            return cls(
                depth=depth, hidden=int(need("hidden_size")), intermediate=int(need("intermediate_size")),
                heads=int(need("num_heads")), kv_heads=int(vc.get("num_key_value_heads") or vc["num_heads"]),
                head_dim=qk, patch=int(need("patch_size")), merge=int(need("spatial_merge_size", 2)),
                temporal_patch=int(need("temporal_patch_size", 2)), window=int(need("visual_token_window_size", 64)),
                window_types=tuple(vc.get("vit_window_attn_types") or [-1] * depth),
                full_blocks=tuple(vc.get("fullatt_block_indexes") or [7, 15, 23, 31]),  # vLLM's defaults
                use_sink=bool(vc.get("use_sink", False)), out_hidden=int(need("out_hidden_size")),
                in_channels=int(vc.get("in_chans", vc.get("in_channels", 3))),
            )
        except ValueError as e:
            raise CheckpointError(f"{path}: vision_config: {e}") from e


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


class PatchEmbed(nn.Module):
    def __init__(self, c: MiMoViTConfig) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(c.hidden, c.in_channels, c.temporal_patch, c.patch, c.patch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C*tp*ps*ps] -> [..., D]
        w = self.proj.weight
        return x @ w.reshape(w.shape[0], -1).t()  # Conv3d with kernel == stride == the patch


class Attention(nn.Module):
    def __init__(self, c: MiMoViTConfig, sink: bool) -> None:
        super().__init__()
        self.c = c
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * c.head_dim)
        self.proj = nn.Linear(c.heads * c.head_dim, c.hidden)
        self.sinks = nn.Parameter(torch.zeros(c.heads)) if sink else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full: bool) -> torch.Tensor:
        c = self.c
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = _rope(q.view(b, n, c.heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, H, N, d]
        k = _rope(k.view(b, n, c.kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = v.view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
        g = c.heads // c.kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # head h reads kv head h // g
        if full:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            o = _band_attention(q, k, v, c.window, self.sinks)
        return self.proj(o.transpose(1, 2).reshape(b, n, c.heads * c.head_dim))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """neox rotation of [B, N, h, d] with cos/sin [N, d/2] (vLLM ``ApplyRotaryEmb``)."""
    cos, sin = cos[None, :, None].to(x.dtype), sin[None, :, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _band_attention(q, k, v, w: int, sinks: torch.Tensor | None, block: int = 256) -> torch.Tensor:
    """Bidirectional attention of [B, H, N, d] restricted to |i - j| <= w, ``sinks[h]`` added to
    key 0's logit (where key 0 is in the band); query blocks see only their key band."""
    n = q.shape[2]
    if w <= 0:  # vLLM's kernel: a window of 0 means none
        w = n
    out = torch.empty_like(q)
    for s in range(0, n, block):
        e = min(n, s + block)
        ks, ke = max(0, s - w), min(n, e + w)
        qi = torch.arange(s, e, device=q.device)[:, None]
        kj = torch.arange(ks, ke, device=q.device)[None, :]
        bias = torch.zeros(q.shape[1], e - s, ke - ks, dtype=q.dtype, device=q.device)  # [H, q, k]
        if sinks is not None and ks == 0:
            bias[:, :, 0] += sinks.to(q.dtype)[:, None]
        bias = bias.masked_fill((qi - kj).abs() > w, float("-inf"))
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:ke], v[:, :, ks:ke], attn_mask=bias)
    return out


class MLP(nn.Module):
    def __init__(self, c: MiMoViTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate)
        self.up_proj = nn.Linear(c.hidden, c.intermediate)
        self.down_proj = nn.Linear(c.intermediate, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: MiMoViTConfig, i: int) -> None:
        super().__init__()
        self.full = i in c.full_blocks
        self.norm1 = RMSNorm(c.hidden, c.eps)
        self.norm2 = RMSNorm(c.hidden, c.eps)
        self.attn = Attention(c, sink=c.use_sink and not self.full)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin, self.full)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, c: MiMoViTConfig) -> None:
        super().__init__()
        m = c.hidden * c.merge ** 2
        self.ln_q = RMSNorm(c.hidden, c.eps)
        self.mlp = nn.Sequential(nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, c.out_hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, D] -> [B, N / m^2, out]
        x = self.ln_q(x)
        return self.mlp(x.reshape(x.shape[0], -1, self.mlp[0].in_features))


class MiMoViT(nn.Module):
    """``forward(patches [B, lh, lw, m*m, P]) -> [B, lh*lw, out_hidden]`` (one frame pair each)."""

    def __init__(self, c: MiMoViTConfig) -> None:
        super().__init__()
        self.c = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.depth))
        self.merger = Merger(c)
        rd = c.head_dim // 2  # vLLM get_rope(head_size=qk, partial_rotary_factor=0.5)
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd)), persistent=False)

    def rotary(self, lh: int, lw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, qk/2] for the rows of a (lh*m, lw*m) grid in merge-block order."""
        m = self.c.merge
        u = torch.arange(lh * lw, device=self.inv_freq.device)
        r, col = u // lw, u % lw  # merged unit row/column
        sub = torch.arange(m * m, device=u.device)
        hpos = (r[:, None] * m + sub[None] // m).reshape(-1)
        wpos = (col[:, None] * m + sub[None] % m).reshape(-1)
        fh, fw = hpos[:, None].float() * self.inv_freq, wpos[:, None].float() * self.inv_freq
        freqs = torch.cat([fh, fw], dim=-1)  # [N, qk/2]
        return freqs.cos(), freqs.sin()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        b, lh, lw, mm, p = patches.shape
        c = self.c
        assert mm == c.merge ** 2 and p == c.in_channels * c.temporal_patch * c.patch ** 2, patches.shape
        dtype = self.patch_embed.proj.weight.dtype
        x = self.patch_embed(patches.to(dtype).reshape(b, lh * lw * mm, p))  # [B, N, D]
        cos, sin = self.rotary(lh, lw)
        col = torch.arange(lh * lw, device=x.device).view(lh, lw).t().reshape(-1)  # unit order by column
        inv = torch.argsort(col)
        col_cos, col_sin = _by_unit(cos, col, mm), _by_unit(sin, col, mm)
        in_col = False
        for blk, kind in zip(self.blocks, c.window_types):
            if (kind == 1) != in_col:
                x = _by_unit(x, col if kind == 1 else inv, mm, dim=1)
                in_col = kind == 1
            x = blk(x, col_cos if in_col else cos, col_sin if in_col else sin)
        if in_col:
            x = _by_unit(x, inv, mm, dim=1)
        return self.merger(x)


def _by_unit(t: torch.Tensor, order: torch.Tensor, mm: int, dim: int = 0) -> torch.Tensor:
    """Reorder ``t`` along ``dim`` in whole merged units of ``mm`` rows."""
    shape = t.shape
    u = t.unflatten(dim, (-1, mm))
    return u.index_select(dim, order).reshape(shape)


class MiMoVisionEncoder(nn.Module):
    """The service's view of the tower: ``forward(patches [B, lh, lw, m*m, P]) -> [B, lh*lw, H]``
    in the LM's hidden size; ``preprocess`` turns pixels into those patches."""

    tokens_per_image = 0  # depends on the image size
    input_kind = "mimo_patches"

    def __init__(self, vit: MiMoViT, preprocess) -> None:
        super().__init__()
        self.vit = vit
        self.preprocess = preprocess
        self.hidden_size = vit.c.out_hidden

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.vit(patches)


def load_mimo_vit(d: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> MiMoVisionEncoder:
    """Build the tower from ``d/config.json`` and load ``visual.*`` strictly: a missing, extra or
    mis-shaped tensor is a ``CheckpointError`` naming the file and the tensor."""
    import json

    from encoder_svc.preprocess.mimo_vision import MiMoVisionPreprocess

    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    vit = MiMoViT(MiMoViTConfig.from_config(cfg, cfg_path))
    pre = MiMoVisionPreprocess.from_config(cfg, cfg_path)
    if (pre.patch, pre.merge, pre.temporal_patch) != (vit.c.patch, vit.c.merge, vit.c.temporal_patch):
        raise CheckpointError(f"{cfg_path}: processor_config patch/merge/temporal sizes disagree with vision_config")
    if cfg.get("hidden_size") not in (None, vit.c.out_hidden):
        raise CheckpointError(f"{cfg_path}: field 'vision_config.out_hidden_size' = {vit.c.out_hidden} differs from "
                              f"the LM's hidden_size = {cfg['hidden_size']}")
    want = vit.state_dict()
    have = {k.removeprefix("visual."): v for k, v in tensors.items() if k.startswith("visual.")}
    index = d / "model.safetensors.index.json"
    weights = index if index.exists() else d / "model.safetensors"
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointError(f"{weights}: tensor 'visual.{missing[0]}' is missing ({len(missing)} ViT tensors "
                              f"missing; vision_config.depth = {vit.c.depth})")
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(f"{weights}: tensor 'visual.{extra[0]}' is not part of the ViT that config.json's "
                              f"vision_config describes ({len(extra)} such tensors)")
    for k, t in want.items():
        if tuple(have[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{weights}: tensor 'visual.{k}' has shape {list(have[k].shape)}; "
                                  f"config.json's vision_config needs {list(t.shape)}")
    vit.load_state_dict(have, strict=True)
    return MiMoVisionEncoder(vit.to(dtype).eval().requires_grad_(False), pre)
