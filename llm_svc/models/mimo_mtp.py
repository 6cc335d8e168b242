"""MiMo-V2's MTP (multi-token prediction) layers, as Xiaomi publishes them under ``model.mtp.layers.M``
(``num_nextn_predict_layers`` of them: 3 on MiMo-V2-Flash and MiMo-V2.5):

    enorm.weight, hnorm.weight                    RMSNorm of the token embedding / of the previous hidden
    eh_proj.weight [H, 2H]                        over concat(enorm(embed), hnorm(hidden)), no bias
    input_layernorm.weight
    self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias; ``fused_qkv``: one qkv_proj)
    self_attn.attention_sink_bias                 (when add_swa_attention_sink_bias)
    pre_mlp_layernorm.weight
    mlp.{gate,up,down}_proj.weight                dense SiLU MLP of intermediate_size (never MoE)
    final_layernorm.weight

One layer is ``final_layernorm(block(eh_proj(cat(enorm(e), hnorm(h)))))`` with one pre-norm
decoder block of the *sliding* attention kind (swa heads / head dims / rope theta, the sliding
window, sinks as the sliding layers); its logits are the shared ``lm_head`` of that output (no
``model.norm``), the token embedding is the shared ``model.embed_tokens`` (vLLM
``mimo_v2_mtp.py`` ``MiMoV2MTPLayer``, SGLang ``mimo_v2_flash_nextn.py``). Chained, layer i at
position t takes layer i-1's output at t (the LM's final-normed hidden for i = 0) and the
embedding of token t+i+1, and predicts token t+i+2.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from shared.bundle import CheckpointError

from .geometry import SLIDING_T, MiMoGeometry
from .mimo_dense import rope, self_attention
from .mimo_blocks import MLP, Attention, RMSNorm, Rotary

MTP_PREFIX = "model.mtp.layers."
_LAYER = re.compile(r"model\.mtp\.layers\.(\d+)\.")


class MTPLayer(nn.Module):
    """One MTP layer; parameter names are the checkpoint's under ``model.mtp.layers.M.``."""

    def __init__(self, g: MiMoGeometry):
        super().__init__()
        h = g.hidden_size
        self.window = g.window
        self.enorm = RMSNorm(h, g.rms_eps)
        self.hnorm = RMSNorm(h, g.rms_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, g.rms_eps)
        self.self_attn = Attention(g, g.sliding)
        self.pre_mlp_layernorm = RMSNorm(h, g.rms_eps)
        self.mlp = MLP(h, g.intermediate_size)
        self.final_layernorm = RMSNorm(h, g.rms_eps)
        self.rotary = Rotary(g)  # no tensors: cos/sin of the sliding kind

    def fuse(self, hidden_prev: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat(enorm(embeds), hnorm(hidden))): the block's input [..., T, H]."""
        return self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden_prev)], dim=-1))

    def forward(self, hidden_prev: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dense reference: hidden_prev, token_embeds [..., T, H] at ``positions [T]`` -> hidden
        [..., T, H] (final-normed: ``lm_head`` of it is this layer's draft, and it is the next
        layer's ``hidden_prev``); causal, sliding-window and sink attention over the T rows."""
        h = self.fuse(hidden_prev, token_embeds)
        cos, sin = rope(self.rotary, h, positions, SLIDING_T)
        h = h + self_attention(self.self_attn, self.input_layernorm(h), cos, sin, self.window)
        h = h + self.mlp(self.pre_mlp_layernorm(h))
        return self.final_layernorm(h)


class MTPStack(nn.Module):
    """``model.mtp``: holds ``layers`` so the module names are the checkpoint's."""

    def __init__(self, g: MiMoGeometry):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(g) for _ in range(g.mtp_layers))


def chain(layers: list[MTPLayer], embed: nn.Embedding, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer teacher-forced over one sequence: hidden [..., T, H] (the LM's final-normed
    states), ids [..., T] -> ``outs[i] [..., T-i-1, H]``, layer i at t (positions 0..) from
    ``outs[i-1][t]`` and ``embed(ids[t+i+1])``; ``lm_head(outs[i][t])`` predicts ``ids[t+i+2]``
    (the last row of each: the token after the sequence)."""
    outs, prev = [], hidden
    t = ids.shape[-1]
    for i, layer in enumerate(layers):
        n = t - i - 1
        if n < 1:
            break
        prev = layer(prev[..., :n, :], embed(ids[..., i + 1:i + 1 + n]), torch.arange(n, device=ids.device))
        outs.append(prev)
    return outs


def check_mtp_layers(files: dict[str, Path], g: MiMoGeometry) -> None:
    """The checkpoint's MTP layers (``files``: model tensor name -> its file) are exactly
    ``num_nextn_predict_layers``; each layer's tensors and shapes are then checked by the strict load."""
    found = sorted({int(m.group(1)) for n in files if (m := _LAYER.match(n))})
    if found == list(range(g.mtp_layers)):
        return
    extra = [i for i in found if i >= g.mtp_layers]
    if extra:
        name = min(n for n in files if n.startswith(f"{MTP_PREFIX}{extra[0]}."))
        raise CheckpointError(f"{files[name]}: tensor {name!r} is MTP layer {extra[0]}, but config.json has "
                              f"num_nextn_predict_layers = {g.mtp_layers}")
    missing = min(set(range(g.mtp_layers)) - set(found))
    raise CheckpointError(f"{next(iter(files.values()))}: config.json has num_nextn_predict_layers = {g.mtp_layers}, "
                          f"but the checkpoint has no tensors of MTP layer {missing} ({MTP_PREFIX}{missing}.*)")
