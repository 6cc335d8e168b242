"""``mmserve tiny-model``: write a tiny random-weight model bundle to disk (no hub needed).

Architectures (``--arch``):

* ``mimo`` (default): ``MiMoV2FlashForCausalLM`` with MiMo-V2.5's layer pattern scaled down
  (1 full-attention layer per 7, sliding window 128, attention sinks on sliding layers, MoE,
  qk head dim != v head dim) + SigLIP vision tower + projector + Whisper encoder + projector,
  as an mmserve bundle (``mmserve_bundle.json``).
* ``gemma3``: a plain HF ``Gemma3ForConditionalGeneration`` directory (5 sliding : 1 full,
  SigLIP tower, ``multi_modal_projector``), exactly the layout of a real Gemma 3 checkpoint.
* ``mimo-v2-flash`` / ``mimo-v2.5``: MiMo-V2 LMs in Xiaomi's published layout (config dialect
  with ``hybrid_layer_pattern`` / ``swa_*``, per-expert weights, MTP heads); ``--layout fused_qkv``
  and ``--quant fp8`` write the hub's fused-QKV / block-FP8 forms of the same weights; see
  ``mmserve/tiny/mimo_published.py``.
* ``mimo-v2.5-omni``: ``MiMoV2OmniForCausalLM`` (MiMo-V2.5 LM + its vision tower, and the audio
  encoder once ``mmserve/tiny/mimo_omni_audio.py`` provides it) in one directory, as Xiaomi
  publishes it; see ``mmserve/tiny/mimo_omni.py``.
* ``gpt-oss``: ``GptOssForCausalLM`` in openai/gpt-oss' config layout, experts unpacked;
  ``--quant mxfp4`` packs them as the hub does (``*_blocks`` / ``*_scales``); see
  ``mmserve/tiny/gpt_oss.py``.
* ``mimo-trained``: the ``mimo-v2-flash`` checkpoint (LM + 3 MTP layers) *trained* on the Python
  standard library by ``scripts/train_tiny_mimo.py``, committed in ``mmserve/tiny/trained_mimo``
  (its ``training.json`` says how and what it reached): text-like greedy output, MTP drafts that
  get accepted.
* ``mimo-trained-qkv``: the same, trained the same way (``--spec flash-qkv``) with qk head dim =
  v head dim (32 / 32), committed in ``mmserve/tiny/trained_mimo_qkv``: the trained checkpoint
  vLLM 0.32's CPU build also serves (it has no attention for qk != v).

Weights are random but seeded, so two runs write identical bundles (``mimo-trained``: a copy).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from shared.bundle import BUNDLE_FORMAT, MANIFEST

from mmserve.tiny.tokenizer import CHATML_SPECIALS, CHATML_TEMPLATE, GEMMA_SPECIALS, GEMMA_TEMPLATE, build_tokenizer  # noqa: F401


def _seed(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def _siglip_config(image_size: int, patch: int):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch,
        num_channels=3,
    )


def write_mimo_bundle(out: Path, sliding_window: int = 128, image_size: int = 64, seed: int = 0) -> Path:
    import torch
    from transformers import (
        MiMoV2FlashConfig,
        MiMoV2FlashForCausalLM,
        SiglipImageProcessor,
        SiglipVisionModel,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperModel,
    )

    from shared.projector import PoolProjector, ProjectorConfig

    _seed(seed)
    tok = build_tokenizer(CHATML_SPECIALS, 640, CHATML_TEMPLATE, eos="<|im_end|>", pad_token="<|endoftext|>")
    hidden = 64
    # MiMo-V2.5-Pro: 70 layers = 10 full + 60 sliding (1 in 7). Scaled down: 7 layers, 1 full.
    layer_types = ["full_attention"] + ["sliding_attention"] * 6
    cfg = MiMoV2FlashConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        mlp_layer_types=["dense"] + ["sparse"] * (len(layer_types) - 1),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        sliding_window=sliding_window,
        max_position_embeddings=8192,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    cfg.architectures = ["MiMoV2FlashForCausalLM"]
    lm = MiMoV2FlashForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves sinks near 0; give them a visible effect
        for layer in lm.model.layers:
            if getattr(layer.self_attn, "sinks", None) is not None:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out)
    tok.save_pretrained(out)

    vis_cfg = _siglip_config(image_size, patch=8)
    vision = SiglipVisionModel(vis_cfg).eval()
    vision.save_pretrained(out / "vision")
    SiglipImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(out / "vision")
    tokens_per_image = 16
    PoolProjector(ProjectorConfig(vis_cfg.hidden_size, hidden, "grid2d", tokens=tokens_per_image)).save(
        out / "vision"
    )

    wcfg = WhisperConfig(
        vocab_size=64,
        num_mel_bins=80,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        max_source_positions=1500,
        max_target_positions=64,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    WhisperModel(wcfg).eval().save_pretrained(out / "audio")
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out / "audio")
    pool_stride = 20
    PoolProjector(ProjectorConfig(wcfg.d_model, hidden, "seq1d", stride=pool_stride)).save(out / "audio")

    manifest = {
        "format": BUNDLE_FORMAT,
        "name": out.name,
        "lm": {"path": ".", "architecture": "MiMoV2FlashForCausalLM"},
        "vision": {
            "kind": "siglip_projector",
            "path": "vision",
            "tokens_per_image": tokens_per_image,
            "video_temporal_pool": 2,
        },
        "audio": {"kind": "whisper_projector", "path": "audio", "pool_stride": pool_stride},
        "placeholders": {
            "image": {"pad": "<|image_pad|>", "start": "<|vision_start|>", "end": "<|vision_end|>"},
            "video": {"pad": "<|video_pad|>", "start": "<|vision_start|>", "end": "<|vision_end|>"},
            "audio": {"pad": "<|audio_pad|>", "start": "<|audio_start|>", "end": "<|audio_end|>"},
        },
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def write_gemma3_checkpoint(out: Path, sliding_window: int = 128, image_size: int = 64, seed: int = 0) -> Path:
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3TextConfig,
    )

    _seed(seed)
    tok = build_tokenizer(
        GEMMA_SPECIALS,
        640,
        GEMMA_TEMPLATE,
        eos="<end_of_turn>",
        pad_token="<pad>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS}
    # Gemma 3: 5 sliding layers then 1 full, repeated.
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    text = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        max_position_embeddings=8192,
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["<end_of_turn>"],
        bos_token_id=ids["<bos>"],
    )
    cfg = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=_siglip_config(image_size, patch=8).to_dict(),
        mm_tokens_per_image=16,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["<end_of_turn>"],
        bos_token_id=ids["<bos>"],
    )
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # Gemma's zero-init norms make a random model too flat
            if p.ndim == 1 and torch.count_nonzero(p) == 0:
                p.normal_(0.0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    Gemma3ImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(out)
    return out


def _mimo_published(preset: str):
    def write(out: Path, sliding_window: int = 128, seed: int = 0, layout: str = "split", quant: str | None = None) -> Path:
        from mmserve.tiny import mimo_published as mp

        return mp.write_mimo_published(out, getattr(mp, preset), seed=seed, sliding_window=sliding_window,
                                       layout=layout, quant=quant)

    return write


TRAINED_MIMO = Path(__file__).resolve().parent / "tiny" / "trained_mimo"
TRAINED_MIMO_QKV = Path(__file__).resolve().parent / "tiny" / "trained_mimo_qkv"  # qk = v: vLLM CPU serves it


def _copy_trained(src: Path, arch: str):
    """A writer that copies the committed trained checkpoint ``src`` to ``out`` (its window and
    weights are what it was trained with: another ``sliding_window`` or ``seed`` is refused)."""

    def write(out: Path, sliding_window: int = 128, seed: int = 0) -> Path:
        import shutil

        window = json.loads((src / "config.json").read_text())["sliding_window_size"]
        if sliding_window != window or seed != 0:
            raise ValueError(f"--arch {arch} is trained with sliding window {window} and fixed weights "
                             f"(no --sliding-window {sliding_window} / --seed {seed})")
        shutil.copytree(src, out, dirs_exist_ok=True)
        return out

    return write


write_trained_mimo = _copy_trained(TRAINED_MIMO, "mimo-trained")
write_trained_mimo_qkv = _copy_trained(TRAINED_MIMO_QKV, "mimo-trained-qkv")


def _gpt_oss(out: Path, sliding_window: int = 128, seed: int = 0, quant: str | None = None) -> Path:
    from mmserve.tiny.gpt_oss import write_gpt_oss

    return write_gpt_oss(out, sliding_window, seed, quant=quant)


ARCHS = {
    "mimo": write_mimo_bundle,
    "gemma3": write_gemma3_checkpoint,
    "mimo-v2-flash": _mimo_published("FLASH"),  # Xiaomi's published layout (mmserve/tiny/mimo_published.py)
    "mimo-v2.5": _mimo_published("V25"),
    "mimo-v2.5-omni": lambda out, sliding_window=128, seed=0: __import__(  # LM + ViT (+ audio), mmserve/tiny/mimo_omni.py
        "mmserve.tiny.mimo_omni", fromlist=["write_mimo_omni"]).write_mimo_omni(out, seed, sliding_window),
    "gpt-oss": _gpt_oss,
    "mimo-trained": write_trained_mimo,  # scripts/train_tiny_mimo.py's checkpoint, committed
    "mimo-trained-qkv": write_trained_mimo_qkv,  # the same with qk = v head dims (--spec flash-qkv)
}
# the published variants each arch can write (``--layout`` / ``--quant``)
VARIANTS = {"mimo-v2-flash": {"layout": ("split", "fused_qkv"), "quant": (None, "fp8")},
            "mimo-v2.5": {"layout": ("split", "fused_qkv"), "quant": (None, "fp8")},
            "gpt-oss": {"quant": (None, "mxfp4")}}


def write_tiny_model(out: str | Path, arch: str = "mimo", sliding_window: int = 128, seed: int = 0,
                     layout: str | None = None, quant: str | None = None) -> Path:
    """Write a tiny bundle of ``arch`` to ``out`` and return its path (``layout`` / ``quant``: a
    published variant, see ``VARIANTS``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    opts = {k: v for k, v in (("layout", layout), ("quant", quant)) if v is not None}
    for k, v in opts.items():
        allowed = VARIANTS.get(arch, {}).get(k, ())
        if v not in allowed:
            raise ValueError(f"--arch {arch} has no --{k} {v} (it has: {[x for x in allowed if x] or 'none'})")
    return ARCHS[arch](Path(out), sliding_window=sliding_window, seed=seed, **opts)
