"""The audio part of a tiny MiMo-V2.5 omni checkpoint, in the published layout.

Called by ``mmserve.tiny.mimo_omni`` (contract in the omni writer): ``audio_part(lm_hidden, seed)``
returns the ``audio_config`` for ``config.json``, the tower tensors for ``model.safetensors``
and the ``audio_tokenizer/`` files. Layout and key set as vLLM 0.32 reads them
(``model_executor/models/mimo_audio.py``: ``MimoAudioEncoderConfig`` field names "match the
audio_config dict in the model checkpoint", ``MiMoAudioTokenizerConfig``,
``_load_audio_tokenizer``; ``mimo_v2_omni.py`` ``hf_to_vllm_mapper``); published values where
known (MiMo-V2.5 ``audio_config``: 20 channels, ``speech_vocab_size`` "1280",
``speech_zeroemb_idx`` "1024", 2-layer projection, ``add_post_norm``, rope 640000, partial
rotary 1.0, as quoted from the real config.json in sglang-jax's MiMo-V2.5 design notes; the
tokenizer's hybrid local/global attention ``encoder_attn_window_size`` [128, 0],
``swa_per_block`` 2, ``encoder_causal``, skip layer 3, as the SGLang-derived ports read it;
mel parameters 24 kHz / n_fft 960 / hop 240 / 128 mels from vLLM's MiMo processor).

Tiny on purpose: widths 32, 8 quantizers of <= 32 codes, a 16-frame window (so short test
clips exercise the windowed layers), ``audio_segment_size`` 800 mel frames (8 s; published
default 6000) so a 20 s clip spans three segments. All float values are bfloat16-representable:
vLLM casts the tokenizer to bfloat16 on load, and the oracle then sees the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path


def audio_config(lm_hidden: int) -> dict:
    return {
        "audio_channels": 8,
        "group_size": 4,
        "input_full_attention": True,
        "input_local_attn_heads": 2,
        "input_local_dim": 32,
        "input_local_head_dim": 16,
        "input_local_hidden_dropout": 0.0,
        "input_local_intermediate_size": 64,
        "input_local_layers": 2,
        "out_hidden_size": lm_hidden,
        "partial_rotary_factor": 1.0,
        "projection_layers": 2,
        "add_post_norm": True,
        "rope_theta": 640000.0,
        "speech_vocab_size": "40",
        "speech_zeroemb_idx": "32",
        "audio_segment_size": 800,
    }


def tokenizer_config() -> dict:
    return {
        "max_audio_seconds": 1800, "stride_size": 2, "avg_pooler": 2, "d_model": 32,
        "scale_embedding": False, "kernel_size": 3, "activation_function": "gelu",
        "encoder_layers": 4, "encoder_skip_layer_id": 3, "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64, "encoder_causal": True, "encoder_attn_window_size": [16, 0],
        "hybrid_attention": True, "hybrid_block_size": 8, "swa_per_block": 2,
        "decoder_layers": 2, "decoder_attention_heads": 2, "decoder_ffn_dim": 64, "decoder_kernel_size": 3,
        "decoder_stride_size": 2, "decoder_causal": True, "decoder_attn_window_size": [-1, -1],
        "nfft": 960, "vocoder_dim": 32, "vocoder_intermediate_dim": 64, "vocoder_num_layers": 2,
        "n_mels": 128, "sampling_rate": 24000, "hop_length": 240, "window_size": 960,
        "vocoder_padding": "same", "fmin": 0, "fmax": None, "num_quantizers": 8,
        "codebook_size": [32, 32, 16, 16, 16, 16, 16, 16], "threshold_ema_dead_code": 2,
        "position_embedding_type": "rope", "rope_theta": 10000, "rope_type": "default",
        "ln_type": "LayerNorm", "vocoder_attention_heads": 2, "vocoder_attn_window_size": [40, 10],
    }


def _gen(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float | None = None, offset: float = 0.0) -> torch.Tensor:
        s = scale if scale is not None else shape[-1] ** -0.5
        return (offset + s * torch.randn(*shape, generator=g)).to(torch.bfloat16).float()

    return rnd


def tower_tensors(cfg: dict, seed: int) -> dict:
    """``speech_embeddings.*`` and ``audio_encoder.*`` of the main ``model.safetensors``."""
    import torch

    rnd = _gen(seed)
    d, f, g = cfg["input_local_dim"], cfg["input_local_intermediate_size"], cfg["group_size"]
    vocab, zero = int(cfg["speech_vocab_size"]), int(cfg["speech_zeroemb_idx"])
    t: dict[str, torch.Tensor] = {}
    for c in range(cfg["audio_channels"]):
        w = rnd(vocab, d, scale=0.5)
        w[zero] = 0.0  # nn.Embedding(padding_idx=speech_zeroemb_idx): that row is zero
        t[f"speech_embeddings.{c}.weight"] = w
    p = "audio_encoder.input_local_transformer"
    for i in range(cfg["input_local_layers"]):
        q = f"{p}.layers.{i}"
        t[f"{q}.input_layernorm.weight"] = rnd(d, scale=0.1, offset=1.0)
        t[f"{q}.post_attention_layernorm.weight"] = rnd(d, scale=0.1, offset=1.0)
        for n in ("q", "k", "v"):
            t[f"{q}.self_attn.{n}_proj.weight"] = rnd(d, d)
            t[f"{q}.self_attn.{n}_proj.bias"] = rnd(d, scale=0.1)
        t[f"{q}.self_attn.o_proj.weight"] = rnd(d, d)
        t[f"{q}.mlp.gate_proj.weight"] = rnd(f, d)
        t[f"{q}.mlp.up_proj.weight"] = rnd(f, d)
        t[f"{q}.mlp.down_proj.weight"] = rnd(d, f)
    t[f"{p}.norm.weight"] = rnd(d, scale=0.1, offset=1.0)
    t["audio_encoder.projection.mlp.0.weight"] = rnd(4 * d * g, d * g)
    t["audio_encoder.projection.mlp.2.weight"] = rnd(cfg["out_hidden_size"], 4 * d * g)
    return t


def tokenizer_tensors(cfg: dict, seed: int) -> dict:
    """``audio_tokenizer/model.safetensors``: the encoder, its RVQ codebooks (with the EMA
    statistics training leaves in the file) and a decoder tensor standing for the decoder and
    vocoder the published file also carries (audio generation; never read here)."""
    import torch

    rnd = _gen(seed + 1)
    d, f, m = cfg["d_model"], cfg["encoder_ffn_dim"], cfg["n_mels"]
    t: dict[str, torch.Tensor] = {
        "encoder.conv1.weight": rnd(d, m, 3, scale=(3 * m) ** -0.5), "encoder.conv1.bias": rnd(d, scale=0.1),
        "encoder.conv2.weight": rnd(d, d, 3, scale=(3 * d) ** -0.5), "encoder.conv2.bias": rnd(d, scale=0.1),
    }
    for i in range(cfg["encoder_layers"]):
        q = f"encoder.layers.{i}"
        for n in ("q", "v", "out"):
            t[f"{q}.self_attn.{n}_proj.weight"] = rnd(d, d)
            t[f"{q}.self_attn.{n}_proj.bias"] = rnd(d, scale=0.1)
        t[f"{q}.self_attn.k_proj.weight"] = rnd(d, d)  # the key projection has no bias
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            t[f"{q}.{ln}.weight"] = rnd(d, scale=0.1, offset=1.0)
            t[f"{q}.{ln}.bias"] = rnd(d, scale=0.1)
        t[f"{q}.fc1.weight"], t[f"{q}.fc1.bias"] = rnd(f, d), rnd(f, scale=0.1)
        t[f"{q}.fc2.weight"], t[f"{q}.fc2.bias"] = rnd(d, f), rnd(d, scale=0.1)
    for ln in ("layer_norm", "down_sample_norm"):
        t[f"encoder.{ln}.weight"] = rnd(d, scale=0.1, offset=1.0)
        t[f"encoder.{ln}.bias"] = rnd(d, scale=0.1)
    t["encoder.down_sample_layer.0.weight"] = rnd(d, d, cfg["avg_pooler"], scale=(2 * d) ** -0.5)
    for i, k in enumerate(cfg["codebook_size"]):
        q = f"encoder.quantizer.vq.layers.{i}._codebook"
        t[f"{q}.embed"] = rnd(k, d, scale=0.7 ** i)  # later levels quantise smaller residuals
        t[f"{q}.embed_avg"] = t[f"{q}.embed"].clone()
        t[f"{q}.cluster_size"] = torch.ones(k)
        t[f"{q}.inited"] = torch.ones(1)
    t["decoder.layer_norm.weight"] = torch.ones(d)
    return t


def audio_files(seed: int) -> dict[str, bytes]:
    """Relative path -> bytes of the ``audio_tokenizer/`` subdirectory."""
    from safetensors.torch import save

    cfg = tokenizer_config()
    return {
        "audio_tokenizer/config.json": (json.dumps(cfg, indent=2) + "\n").encode(),
        "audio_tokenizer/model.safetensors": save(tokenizer_tensors(cfg, seed), metadata={"format": "pt"}),
    }


def audio_part(lm_hidden: int, seed: int):
    """The omni writer's hook: an ``OmniPart`` with the whole audio side."""
    from mmserve.tiny.omni_part import OmniPart

    cfg = audio_config(lm_hidden)
    return OmniPart(config={"audio_config": cfg}, processor_config={}, tensors=tower_tensors(cfg, seed),
                    files=audio_files(seed))



def write_audio_only(out: Path, lm_hidden: int = 64, seed: int = 0) -> Path:
    """A directory with just the audio side (``config.json`` with ``hidden_size`` and
    ``audio_config``, the tower tensors, ``audio_tokenizer/``): for tower tests that need no LM."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = audio_config(lm_hidden)
    (out / "config.json").write_text(json.dumps({"hidden_size": lm_hidden, "audio_config": cfg}, indent=2))
    save_file(tower_tensors(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    for rel, data in audio_files(seed).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return out
