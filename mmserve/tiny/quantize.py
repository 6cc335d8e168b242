"""Writer-side quantizers for tiny checkpoints in the publishers' quantized layouts (the loader's
dequantizers live in ``llm_svc/models/quant.py``; ``shared`` never imports them).

* block FP8 (``weight`` e4m3 + ``weight_scale_inv`` float32, one scale per ``Bo x Bi`` block,
  scale = block amax / 448), as DeepSeek-V3 / MiMo publish it; ``row_groups`` quantizes each row
  chunk on its own (MiMo's fused ``qkv_proj``: per-chunk scale rows, vLLM ``mimo_v2.py``).
* MXFP4 (``*_blocks`` / ``*_scales``), as openai/gpt-oss publish their experts: groups of 32 along
  the last dim, E8M0 exponent = ceil(log2(amax / 6)), E2M1 nibbles rounded to nearest.
"""

from __future__ import annotations

FP8_QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}
E4M3_MAX = 448.0
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_fp8_block(w, block: tuple[int, int] = (128, 128), row_groups: int = 1):
    """float ``[R, C]`` -> (e4m3 ``[R, C]``, float32 scale grid; ``row_groups`` grids stacked)."""
    import torch

    if row_groups > 1:
        parts = [quantize_fp8_block(c, block) for c in w.chunk(row_groups, dim=0)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    bo, bi = block
    rows, cols = w.shape
    pr, pc = -(-rows // bo) * bo, -(-cols // bi) * bi
    padded = torch.zeros(pr, pc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(pr // bo, bo, pc // bi, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # [R/Bo, C/Bi]
    q = (blocks / scale[:, None, :, None]).view(pr, pc)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def quantize_mxfp4(w):
    """float ``[..., N, K]`` (K a multiple of 32) -> (blocks uint8 ``[..., N, K/32, 16]``,
    scales uint8 ``[..., N, K/32]``); element ``2i`` of a group goes to the low nibble."""
    import torch

    *lead, k = w.shape
    g = w.float().reshape(*lead, k // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp(min=1e-30) / 6.0)), torch.zeros_like(amax))
    exp = exp.clamp(-127, 127)
    scaled = (g / torch.exp2(exp)[..., None]).clamp(-6.0, 6.0)
    mags = torch.tensor(FP4_MAGNITUDES)
    code = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude index 0..7
    code = (code + 8 * (scaled < 0)).to(torch.uint8)  # bit 3: sign
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # [..., G, 16]
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()
