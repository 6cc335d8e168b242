"""Tiny MiMo-V2.5 omni checkpoint (``--arch mimo-v2.5-omni``) in Xiaomi's published layout.

One directory holds the LM, the vision tower (and, through ``mimo_omni_audio.audio_part``, the
audio encoder), as XiaomiMiMo/MiMo-V2.5 ships them:

* ``config.json``: ``architectures: [MiMoV2OmniForCausalLM]``, ``model_type: mimo_v2``, the LM
  keys in the published dialect (``mimo_published.published_config``), ``vision_config`` with
  the keys vLLM 0.32's ``Mimo_VLVisionConfig`` reads (``depth, hidden_size, intermediate_size,
  num_heads, num_key_value_heads, qk_channels, kv_channels, patch_size, spatial_merge_size,
  temporal_patch_size, fullatt_block_indexes, vit_window_attn_types, visual_token_window_size,
  use_sink, out_hidden_size, tokens_per_second`` ...; the key set of the published file as
  mirrored by public loaders, e.g. ``in_chans``, ``num_query_groups``, ``spatial_patch_size``,
  ``window_size``), a ``processor_config`` (what vLLM's ``MiMoOmniProcessor.from_hf_config``
  reads: pixel bounds, ``*_token_id``; ``rope_type: rope``, ``use_video_timestamps: true``) and
  the media token ids at top level.
* ``model.safetensors``: the LM under ``model.`` / ``lm_head.`` and the ViT under ``visual.``
  (vLLM ``MiMoV2OmniForCausalLM.hf_to_vllm_mapper``: ``visual.`` for the original checkpoint):
  ``patch_embed.proj.weight`` (Conv3d, no bias), ``blocks.N.{norm1,norm2}.weight`` (RMSNorm),
  ``blocks.N.attn.qkv.{weight,bias}`` (fused, GQA), ``blocks.N.attn.proj.{weight,bias}``,
  ``blocks.N.attn.sinks`` (window blocks with ``use_sink``), ``blocks.N.mlp.{gate,up,down}_proj
  .{weight,bias}``, ``merger.ln_q.weight``, ``merger.mlp.{0,2}.weight``.
* tokenizer files with the omni special tokens (``<|vision_start|> <|vision_end|> <|image_pad|>
  <|video_pad|>`` and ``<|mimo_audio_start|> <|audio_pad|> <|mimo_audio_end|>`` as vLLM's
  placeholders name them; ``<|mimo_video_start|>`` as public special-token tables list MiMo's
  video marker, ``<|mimo_video_end|>`` by symmetry (an assumption: readers take the ids from
  ``processor_config``, never the names) and a chat template that renders the placeholders
  vLLM's ``get_placeholder_str`` names.
* ``preprocessor_config.json`` as on the hub (https://huggingface.co/XiaomiMiMo/MiMo-V2.5-Base/
  blob/main/preprocessor_config.json: ``Qwen2VLImageProcessor``, patch 16, CLIP mean/std). The
  serving stacks (vLLM's and SGLang's MiMo processors) do not read it: they resize with
  ``F.interpolate(bilinear)`` and normalize with ImageNet mean/std in 0..255 units; mmserve
  follows them (see ``encoder_svc/preprocess/mimo_vision.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from mmserve.tiny.mimo_published import V25, mtp_shapes, published_config, published_shapes, random_tensors
from mmserve.tiny.tokenizer import chatml_template

OMNI_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "<|mimo_video_start|>", "<|mimo_video_end|>", "<|mimo_audio_start|>", "<|mimo_audio_end|>",
    "<|audio_pad|>",
]
OMNI_TEMPLATE = chatml_template("<|mimo_audio_start|>", "<|mimo_audio_end|>")  # vLLM get_placeholder_str


@dataclass(frozen=True)
class TinyVisionSpec:
    """A tiny MiMo ViT: real structure (GQA, 2-D rope, row/column window blocks with sinks, a
    full block, spatial merge 2, temporal patch 2), small sizes; a window of 8 merged-unit rows
    so the window masks matter on small images."""

    depth: int = 4
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16  # qk_channels = kv_channels
    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    window: int = 8  # visual_token_window_size
    window_types: tuple[int, ...] = (-1, 0, 1, 0)
    full_blocks: tuple[int, ...] = (0,)
    use_sink: bool = True


VISION = TinyVisionSpec()


def vision_config(v: TinyVisionSpec, out_hidden: int) -> dict:
    return {
        "depth": v.depth, "hidden_size": v.hidden, "hidden_act": "silu", "intermediate_size": v.intermediate,
        "num_heads": v.heads, "num_key_value_heads": v.kv_heads, "num_query_groups": v.kv_heads,
        "qk_channels": v.head_dim, "kv_channels": v.head_dim, "in_chans": 3, "patch_size": v.patch,
        "spatial_patch_size": v.patch, "spatial_merge_size": v.merge, "temporal_patch_size": v.temporal_patch,
        "tokens_per_second": 2, "window_size": 128, "visual_token_window_size": v.window,
        "vit_window_attn_types": list(v.window_types), "fullatt_block_indexes": list(v.full_blocks),
        "use_sink": v.use_sink, "out_hidden_size": out_hidden,
    }


def vision_shapes(v: TinyVisionSpec, out_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every ViT tensor under ``visual.`` with its shape (vLLM ``MiMoVisionTransformer`` names)."""
    h, d = v.hidden, v.head_dim
    out: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": (h, 3, v.temporal_patch, v.patch, v.patch)}
    qkv = (v.heads + 2 * v.kv_heads) * d
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        out[p + "norm1.weight"] = (h,)
        out[p + "norm2.weight"] = (h,)
        out[p + "attn.qkv.weight"] = (qkv, h)
        out[p + "attn.qkv.bias"] = (qkv,)
        out[p + "attn.proj.weight"] = (h, v.heads * d)
        out[p + "attn.proj.bias"] = (h,)
        if v.use_sink and i not in v.full_blocks:
            out[p + "attn.sinks"] = (v.heads,)
        for name, shape in (("gate_proj", (v.intermediate, h)), ("up_proj", (v.intermediate, h)),
                            ("down_proj", (h, v.intermediate))):
            out[f"{p}mlp.{name}.weight"] = shape
            out[f"{p}mlp.{name}.bias"] = (shape[0],)
    m = h * v.merge ** 2
    out["visual.merger.ln_q.weight"] = (h,)
    out["visual.merger.mlp.0.weight"] = (m, m)
    out["visual.merger.mlp.2.weight"] = (out_hidden, m)
    return out


def write_mimo_omni(out: Path, seed: int = 0, sliding_window: int | None = None,
                    vision: TinyVisionSpec = VISION, vision_extra: dict | None = None,
                    drop_tensors: tuple[str, ...] = ()) -> Path:
    """Write the tiny omni checkpoint to ``out``. ``vision_extra`` adds/overrides
    ``vision_config`` keys and ``drop_tensors`` leaves tensors out (tests of bad checkpoints)."""
    from safetensors.torch import save_file

    from mmserve.tiny.mimo_omni_audio import audio_part
    from mmserve.tiny.tokenizer import build_tokenizer

    spec = replace(V25, architecture="MiMoV2OmniForCausalLM")
    if sliding_window is not None:
        spec = replace(spec, window=sliding_window)
    tok = build_tokenizer(OMNI_SPECIALS, 640, OMNI_TEMPLATE, eos="<|im_end|>", pad_token="<|endoftext|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in OMNI_SPECIALS}
    vocab = -(-len(tok) // 64) * 64
    cfg = published_config(spec, vocab, ids["<|im_end|>"], ids["<|endoftext|>"])
    media_ids = {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "audio_token_id": ids["<|audio_pad|>"], "audio_start_token_id": ids["<|mimo_audio_start|>"],
        "audio_end_token_id": ids["<|mimo_audio_end|>"],
    }
    unit = vision.patch * vision.merge
    cfg.update(media_ids)
    cfg["vision_config"] = {**vision_config(vision, spec.hidden), **(vision_extra or {})}
    cfg["processor_config"] = {
        "rope_type": "rope", "use_video_timestamps": True, "use_per_grid_t_timestamps": False,
        "temporal_compression_ratio": 1, "patch_size": vision.patch, "merge_size": vision.merge,
        "temporal_patch_size": vision.temporal_patch,
        # tiny bounds (the hub's are thousands of merged tokens): images 4..64, video frames 4..16 tokens
        "image_min_pixels": 4 * unit * unit, "image_max_pixels": 64 * unit * unit,
        "video_min_pixels": 4 * unit * unit, "video_max_pixels": 16 * unit * unit,
        "video_total_max_pixels": 128 * unit * unit,
        **media_ids, "video_start_token_id": ids["<|mimo_video_start|>"],
        "video_end_token_id": ids["<|mimo_video_end|>"],
    }
    lm, mtp = published_shapes(spec, vocab), mtp_shapes(spec)
    lm = {k: v for k, v in lm.items() if k not in mtp}
    state = random_tensors({**lm, **vision_shapes(vision, spec.hidden), **mtp}, seed)  # MTP last: towers as before
    audio = audio_part(spec.hidden, seed + 2)
    if audio is not None:
        cfg.update(audio.config)
        cfg["processor_config"].update(audio.processor_config)
        state.update(audio.tensors)
    for name in drop_tensors:
        del state[name]
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for rel, data in (audio.files if audio is not None else {}).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"]], "pad_token_id": ids["<|endoftext|>"], "do_sample": False,
         "transformers_version": "4.57.1"}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}, indent=2))
    tok.save_pretrained(out)
    from mmserve.tiny.mimo_published import _V2_CONFIG_CODE

    (out / "configuration_mimo_v2.py").write_text(_V2_CONFIG_CODE)
    return out
