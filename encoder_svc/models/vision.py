"""Vision encoders: pixels [B, 3, h, w] -> LM-space tokens [B, tokens_per_image, lm_hidden].

Three kinds, chosen by ``VisionSpec.kind`` (registry ``VISION_LOADERS``):

* ``siglip_projector`` (mmserve bundle): ``SiglipVisionModel(...).last_hidden_state`` ->
  ``shared.projector.PoolProjector`` (grid2d pooling to ``tokens_per_image``).
* ``mimo_omni`` (MiMo-V2.5 omni dir): the ``visual.`` ViT + merger (``models/mimo_vit.py``);
  takes patch rows, not pixels, and gives a size-dependent token count.
* ``gemma3`` (plain HF Gemma 3 dir): ``model.vision_tower`` -> ``model.multi_modal_projector``,
  i.e. ``Gemma3ForConditionalGeneration.get_image_features(pixel_values).pooler_output``;
  only those weights are read from the checkpoint, the language model is never loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.bundle import BundleError, VisionSpec
from shared.projector import PoolProjector
from shared.registry import Registry

# kind -> loader(root, spec, dtype) of its encoder
VISION_LOADERS: Registry[Callable[[Path, VisionSpec, torch.dtype], nn.Module]] = Registry("vision kind", error=BundleError)


class VisionEncoder(nn.Module):
    """Tower + projector. ``forward``: float [B, 3, h, w] -> [B, tokens_per_image, hidden]."""

    def __init__(self, tower: nn.Module, projector: nn.Module, tokens_per_image: int, hidden_size: int) -> None:
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.tokens_per_image = tokens_per_image
        self.hidden_size = hidden_size

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = next(self.tower.parameters()).dtype
        feats = self.tower(pixel_values=pixel_values.to(dtype)).last_hidden_state  # [B, N, Dv]
        out = self.projector(feats)  # [B, T, H]
        assert out.shape[1:] == (self.tokens_per_image, self.hidden_size), out.shape
        return out


@VISION_LOADERS.register("siglip_projector")
def _load_siglip_projector(root: Path, spec: VisionSpec, dtype: torch.dtype) -> VisionEncoder:
    from transformers import SiglipVisionModel

    d = root / spec.path
    tower = SiglipVisionModel.from_pretrained(d, dtype=dtype).eval()
    projector = PoolProjector.load(d).to(dtype).eval()
    if projector.cfg.pool != "grid2d" or projector.cfg.tokens != spec.tokens_per_image:
        raise BundleError(f"{d}: projector gives {projector.cfg.tokens} tokens, manifest says {spec.tokens_per_image}")
    return VisionEncoder(tower, projector, spec.tokens_per_image, projector.cfg.out_dim)


def _checkpoint_tensors(d: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors whose name (after an optional leading ``model.``) starts with a prefix."""
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            for key in f.keys():
                k = key.removeprefix("model.")
                if k.startswith(prefixes):
                    out[k] = f.get_tensor(key)
    return out


def _load_into(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    want = set(module.state_dict())
    if not want <= set(state):  # older checkpoints nest the SigLIP tower under vision_model.
        state = {k.removeprefix("vision_model."): v for k, v in state.items()}
    missing = want - set(state)
    if missing:
        raise BundleError(f"checkpoint lacks {len(missing)} weights of {prefix!r}, e.g. {sorted(missing)[:3]}")
    module.load_state_dict({k: state[k] for k in want}, strict=True)


@VISION_LOADERS.register("gemma3")
def _load_gemma3(root: Path, spec: VisionSpec, dtype: torch.dtype) -> VisionEncoder:
    from transformers import AutoConfig, AutoModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    d = root / spec.path
    cfg = AutoConfig.from_pretrained(d)
    tower = AutoModel.from_config(cfg.vision_config)
    projector = Gemma3MultiModalProjector(cfg)
    tensors = _checkpoint_tensors(d, ("vision_tower.", "multi_modal_projector."))
    _load_into(tower, tensors, "vision_tower.")
    _load_into(projector, tensors, "multi_modal_projector.")
    return VisionEncoder(
        tower.to(dtype).eval(), projector.to(dtype).eval(), cfg.mm_tokens_per_image, cfg.text_config.hidden_size
    )


@VISION_LOADERS.register("mimo_omni")
def _load_mimo_omni(root: Path, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
    from encoder_svc.models.mimo_vit import load_mimo_vit

    d = root / spec.path
    return load_mimo_vit(d, _checkpoint_tensors(d, ("visual.",)), dtype)


def load_vision(root: Path, spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
    """The encoder of ``spec.kind``; an unknown kind is a ``BundleError``."""
    return VISION_LOADERS.get(spec.kind)(root, spec, dtype)
