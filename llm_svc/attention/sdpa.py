"""``sdpa``: the batched backend's buckets attended with ``scaled_dot_product_attention``.

On CUDA that is a fused kernel (memory-efficient / flash / cuDNN, chosen by torch); on CPU it
runs too (and is tested equal to ``torch_batched``), but measured slower there than the matmul
softmax, so it is the CUDA default only (``DEFAULT_BY_DEVICE``).

Exactness tricks, all mask-level so any SDPA kernel can take them:
* GQA without ``enable_gqa``: the ``G`` query heads of one KV head are stacked along the query
  axis (``q [B, Hkv, G * nq, D]``), so K/V are never repeated.
* Sliding window, Gemma 3 bidirectional spans, padding: the bucket's additive bias (0 / -inf).
* MiMo's per-head sinks: one extra key with ``k = 0``, ``v = 0`` and bias ``sink[h]``: its
  logit is ``q . 0 * scale + sink[h] = sink[h]``, it takes its share of the softmax mass and
  adds nothing to the output, exactly the extra logit column of ``torch_common.attend``.
* Logit soft-capping cannot be expressed as a mask: such layers use the matmul path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ATTENTION_BACKENDS
from .base import AttentionParams
from .torch_batched import TorchBatchedAttention


def attend_sdpa(q, k, v, bias, params: AttentionParams) -> torch.Tensor:
    """q [B, nq, Hq, D], k [Hkv, B, L, D], v [Hkv, B, L, Dv], bias [B, nq, L] (0 / -inf)
    -> [B, nq, Hq, Dv]; same result as ``torch_common.attend`` (without soft-cap)."""
    b, nq, hq, d = q.shape
    hkv, _, L, dv = v.shape
    g = hq // hkv
    qs = q.reshape(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * nq, d)  # [B, Hkv, G*nq, D]
    ks, vs = k.transpose(0, 1), v.transpose(0, 1)  # [B, Hkv, L, D] views
    mask = bias[:, None, None].expand(b, 1, g, nq, L).reshape(b, 1, g * nq, L)  # [B, 1, G*nq, L]
    if params.sinks is not None:
        ks = torch.cat([ks, ks.new_zeros(b, hkv, 1, d)], dim=2)  # [B, Hkv, L + 1, D]
        vs = torch.cat([vs, vs.new_zeros(b, hkv, 1, dv)], dim=2)
        sink = params.sinks.to(mask.dtype).reshape(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        mask = torch.cat([mask.expand(b, hkv, g * nq, L), sink.reshape(b, hkv, g * nq, 1)], dim=-1)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(qs.dtype), scale=params.scale)
    return o.view(b, hkv, g, nq, dv).permute(0, 3, 1, 2, 4).reshape(b, nq, hq, dv)


@ATTENTION_BACKENDS.register("sdpa")
class SDPAAttention(TorchBatchedAttention):
    """``torch_batched``'s metadata (buckets, slot-table gathers, biases) + SDPA per bucket."""

    name = "sdpa"

    def attend(self, q, k, v, bias, params: AttentionParams) -> torch.Tensor:
        if params.softcap is not None:
            return super().attend(q, k, v, bias, params)
        return attend_sdpa(q, k, v, bias, params)
