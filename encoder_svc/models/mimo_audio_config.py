"""The two configs of the MiMo-V2.5 omni audio side, read as published and checked at startup.

Published layout (vLLM 0.32 ``model_executor/models/mimo_audio.py`` ``MimoAudioEncoder``, which
loads ``<checkpoint>/audio_tokenizer``; ``mimo_v2_omni.py`` builds it from ``config.audio_config``):

    <checkpoint>/config.json                 "audio_config": {...}        -> AudioEncoderConfig
    <checkpoint>/model.safetensors (+index)  speech_embeddings.*, audio_encoder.*
    <checkpoint>/audio_tokenizer/config.json  MiMo-Audio-Tokenizer        -> AudioTokenizerConfig
    <checkpoint>/audio_tokenizer/model.safetensors   encoder.* (decoder/vocoder tensors unused)

The audio side is not a continuous encoder: 24 kHz mono -> log-mel (100 frames/s) -> the
tokenizer's conv + transformer encoder (50 frames/s) -> 2x down-sampling (25 frames/s) ->
residual VQ codes [T, audio_channels] -> per-channel ``speech_embeddings`` summed -> groups of
``group_size`` code frames through a small Qwen2-style "input local transformer" -> projection
-> ONE LM token per group (6.25 tokens/s for the published 4-frame groups).

Keys the vLLM code reads are honoured; keys that only the tokenizer's decoder/vocoder (audio
generation) or training use are accepted and ignored; any other key is an error naming the file
and the key, as is a value this implementation cannot reproduce exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from shared.bundle import CheckpointError

TOKENIZER_DIR = "audio_tokenizer"

# keys PretrainedConfig.to_dict() writes into any config.json
_HF_KEYS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "_name_or_path", "_attn_implementation_autoset", "output_hidden_states", "return_dict",
    "use_cache", "tie_word_embeddings", "is_encoder_decoder", "id2label", "label2id",
}
# MiMoAudioTokenizerConfig keys that only the decoder / vocoder / training read
_TOKENIZER_UNUSED = {
    "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim", "decoder_kernel_size",
    "decoder_stride_size", "decoder_causal", "decoder_attn_window_size", "vocoder_dim",
    "vocoder_intermediate_dim", "vocoder_num_layers", "vocoder_padding", "vocoder_attention_heads",
    "vocoder_attn_window_size", "use_istft_only", "threshold_ema_dead_code", "max_audio_seconds",
    "hybrid_block_size",
    # vLLM computes embed_scale from it and never applies it (AudioEncoder.get_features)
    "scale_embedding",
}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} not found: the MiMo omni audio side needs it") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _int_list(value, n: int, where: str) -> list[int]:
    """``"1025-1025-129"`` / ``"1280"`` / ``1280`` / ``[..]`` -> n ints (vLLM ``_parse_maybe_list``)."""
    if isinstance(value, list):
        out = [int(v) for v in value]
    elif isinstance(value, str) and "-" in value:
        out = [int(s) for s in value.split("-")]
    else:
        out = [int(value)] * n
    if len(out) < n:
        raise CheckpointError(f"{where}: {len(out)} values for {n} audio channels")
    return out[:n]


@dataclass(frozen=True)
class AudioTokenizerConfig:
    """The encoder half of MiMo-Audio-Tokenizer (mel front-end + conv/transformer + RVQ)."""

    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    encoder_skip_layer_id: int | None  # 1-based layer whose output is added before layer_norm
    encoder_causal: bool
    window: tuple[int, int]  # (left, right) flash-attn window of the windowed layers; -1 = none
    hybrid_attention: bool  # windowed layers i % swa_per_block < swa_per_block - 1, others full
    swa_per_block: int
    stride_size: int
    avg_pooler: int
    num_quantizers: int
    codebook_sizes: tuple[int, ...]  # one per quantizer
    rope_theta: float
    # mel front-end (torchaudio MelSpectrogram(power=1, center=True) -> log(clamp(1e-7)))
    sampling_rate: int
    n_mels: int
    nfft: int
    hop_length: int
    window_size: int
    fmin: float
    fmax: float | None
    kernel_size: int = 3

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads or (self.d_model // self.encoder_attention_heads) % 2:
            raise CheckpointError(f"d_model {self.d_model} must split into an even head dim over "
                                  f"{self.encoder_attention_heads} heads")
        if self.encoder_skip_layer_id is not None and not 1 <= self.encoder_skip_layer_id <= self.encoder_layers:
            raise CheckpointError(f"encoder_skip_layer_id {self.encoder_skip_layer_id} is not a layer")
        if min(self.stride_size, self.avg_pooler, self.swa_per_block, self.num_quantizers) < 1:
            raise CheckpointError("stride_size, avg_pooler, swa_per_block, num_quantizers must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    def layer_window(self, i: int) -> tuple[int, int]:
        if self.hybrid_attention:
            return self.window if i % self.swa_per_block < self.swa_per_block - 1 else (-1, -1)
        return self.window

    def mel_frames(self, num_samples: int) -> int:
        return 1 + num_samples // self.hop_length  # centered STFT

    def conv_frames(self, mel_len: int) -> int:
        """vLLM ``get_output_length``: conv1 (stride 1, pad 1) then conv2 (stride s, pad 1)."""
        return (mel_len + 3 - self.kernel_size + 2 - self.kernel_size) // self.stride_size + 1

    def code_frames(self, mel_len: int) -> int:
        return math.ceil(self.conv_frames(mel_len) / self.avg_pooler)

    @classmethod
    def from_dir(cls, root: Path) -> "AudioTokenizerConfig":
        path = root / TOKENIZER_DIR / "config.json"
        c = _read(path)
        known = {f for f in cls.__dataclass_fields__} - {"window", "codebook_sizes"}
        known |= {"encoder_attn_window_size", "codebook_size", "activation_function", "ln_type",
                  "position_embedding_type", "rope_type"}
        for k in c:
            if k not in known and k not in _TOKENIZER_UNUSED and k not in _HF_KEYS:
                raise CheckpointError(f"{path}: unknown key {k!r}; this MiMo audio tokenizer cannot map it")
        # what the equations below implement (vLLM: ACT2FN[...], LAYER_NORM[...], rope only)
        for k, want in (("activation_function", "gelu"), ("ln_type", "LayerNorm"),
                        ("position_embedding_type", "rope"), ("rope_type", "default"), ("kernel_size", 3)):
            if c.get(k, want) != want:
                raise CheckpointError(f"{path}: {k}={c[k]!r} is not supported (only {want!r})")
        # the defaults are MiMoAudioTokenizerConfig's (vLLM mimo_audio.py)
        n_q = int(c.get("num_quantizers", 12))
        sizes = c.get("codebook_size") or [1024]
        sizes = [int(sizes)] * n_q if isinstance(sizes, int) else [int(s) for s in sizes]
        sizes = (sizes + [sizes[-1]] * n_q)[:n_q]  # ResidualVectorQuantization extends with the last
        win = c.get("encoder_attn_window_size") or [-1, -1]
        if len(win) != 2:
            raise CheckpointError(f"{path}: encoder_attn_window_size must be [left, right], got {win!r}")
        try:
            return cls(
                d_model=int(c.get("d_model", 768)),
                encoder_layers=int(c.get("encoder_layers", 8)),
                encoder_attention_heads=int(c.get("encoder_attention_heads", 12)),
                encoder_ffn_dim=int(c.get("encoder_ffn_dim", 3072)),
                encoder_skip_layer_id=c.get("encoder_skip_layer_id"),
                encoder_causal=bool(c.get("encoder_causal", False)),
                window=(int(win[0]), int(win[1])),
                hybrid_attention=bool(c.get("hybrid_attention", False)),
                swa_per_block=int(c.get("swa_per_block", 2)),
                stride_size=int(c.get("stride_size", 2)),
                avg_pooler=int(c.get("avg_pooler", 1)),
                num_quantizers=n_q,
                codebook_sizes=tuple(sizes),
                rope_theta=float(c.get("rope_theta", 10000)),
                sampling_rate=int(c.get("sampling_rate", 24000)),
                n_mels=int(c.get("n_mels", 80)),
                nfft=int(c.get("nfft", 1024)),
                hop_length=int(c.get("hop_length", 240)),
                window_size=int(c.get("window_size", 1024)),
                fmin=float(c.get("fmin", 0) or 0),
                fmax=None if c.get("fmax") is None else float(c["fmax"]),
            )
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None


@dataclass(frozen=True)
class AudioEncoderConfig:
    """``config.json["audio_config"]``: code embeddings + input local transformer + projection."""

    audio_channels: int
    group_size: int
    speech_vocab_sizes: tuple[int, ...]
    speech_zeroemb_idx: tuple[int, ...]
    input_local_layers: int
    input_local_dim: int
    input_local_attn_heads: int
    input_local_intermediate_size: int
    input_full_attention: bool
    out_hidden_size: int
    rope_theta: float
    projection_layers: int
    add_post_norm: bool
    audio_segment_size: int  # mel frames per independently encoded segment (60 s)
    rms_norm_eps: float = 1e-6  # transformers Qwen2Config default; audio_config has no key for it

    def __post_init__(self) -> None:
        dim, heads = self.input_local_dim, self.input_local_attn_heads
        if dim % heads or (dim // heads) % 2:
            raise CheckpointError(f"input_local_dim {self.input_local_dim} must split into an even head dim "
                                  f"over {self.input_local_attn_heads} heads")
        if self.projection_layers not in (1, 2):
            raise CheckpointError(f"projection_layers must be 1 or 2, got {self.projection_layers}")
        if min(self.audio_channels, self.group_size, self.audio_segment_size, self.input_local_layers) < 1:
            raise CheckpointError("audio_channels, group_size, audio_segment_size, input_local_layers must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.input_local_dim // self.input_local_attn_heads

    @classmethod
    def from_dir(cls, root: Path) -> "AudioEncoderConfig":
        path = root / "config.json"
        top = _read(path)
        c = top.get("audio_config")
        if not isinstance(c, dict):
            raise CheckpointError(f"{path}: no 'audio_config' object; the checkpoint has no audio side")
        known = {"speech_vocab_size", "speech_zeroemb_idx", "group_size", "audio_channels",
                 "input_local_layers", "input_local_dim", "input_full_attention", "input_local_attn_heads",
                 "input_local_head_dim", "input_local_intermediate_size", "input_local_hidden_dropout",
                 "out_hidden_size", "rope_theta", "partial_rotary_factor", "projection_layers",
                 "add_post_norm", "audio_segment_size", "sampling_rate", "sample_rate"}
        where = f"{path} audio_config"
        for k in c:
            if k not in known:
                raise CheckpointError(f"{where}: unknown key {k!r}; this MiMo audio encoder cannot map it")
        # vLLM builds transformers' Qwen2Model(partial_rotary_factor=...), which (5.17 and 5.19,
        # checked) rotates the whole head anyway; the published model says 1.0. Refuse others
        # rather than pick one of two readings.
        prf = float(c.get("partial_rotary_factor", 1.0))
        if prf != 1.0:
            raise CheckpointError(f"{where}: partial_rotary_factor={prf} is not supported (only 1.0)")
        sr = c.get("sampling_rate", c.get("sample_rate"))
        if sr is not None and int(sr) != AudioTokenizerConfig.from_dir(root).sampling_rate:
            raise CheckpointError(f"{where}: sampling_rate {sr} disagrees with {TOKENIZER_DIR}/config.json")
        n = int(c.get("audio_channels", 8))
        heads = int(c.get("input_local_attn_heads", 64))
        dim = int(c.get("input_local_dim", 1024))
        hd = c.get("input_local_head_dim")
        if hd is not None and int(hd) * heads != dim:
            # Qwen2Model derives head_dim = hidden / heads; a different input_local_head_dim is ignored
            raise CheckpointError(f"{where}: input_local_head_dim {hd} x {heads} heads != input_local_dim {dim}")
        try:
            return cls(
                audio_channels=n,
                group_size=int(c.get("group_size", 4)),
                speech_vocab_sizes=tuple(_int_list(c.get("speech_vocab_size", "1025-1025-129-129-129-129-129-129"),
                                                   n, f"{where} speech_vocab_size")),
                speech_zeroemb_idx=tuple(_int_list(c.get("speech_zeroemb_idx", "1024-1024-128-128-128-128-128-128"),
                                                   n, f"{where} speech_zeroemb_idx")),
                input_local_layers=int(c.get("input_local_layers", 6)),
                input_local_dim=dim,
                input_local_attn_heads=heads,
                input_local_intermediate_size=int(c.get("input_local_intermediate_size", 4096)),
                input_full_attention=bool(c.get("input_full_attention", True)),
                out_hidden_size=int(c.get("out_hidden_size", 4096)),
                rope_theta=float(c.get("rope_theta", 640000.0)),
                projection_layers=int(c.get("projection_layers", 1)),
                add_post_norm=bool(c.get("add_post_norm", False)),
                audio_segment_size=int(c.get("audio_segment_size", 6000)),
            )
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None


def check_pair(root: Path, enc: AudioEncoderConfig, tok: AudioTokenizerConfig, lm_hidden: int | None) -> None:
    """Invariants across the two files (and the LM) that no single config can check."""
    where = f"{root / 'config.json'} audio_config"
    if enc.audio_channels > tok.num_quantizers:
        raise CheckpointError(f"{where}: audio_channels {enc.audio_channels} > num_quantizers "
                              f"{tok.num_quantizers} of {TOKENIZER_DIR}/config.json")
    for i in range(enc.audio_channels):
        if tok.codebook_sizes[i] > enc.speech_vocab_sizes[i]:
            raise CheckpointError(f"{where}: speech_vocab_size[{i}]={enc.speech_vocab_sizes[i]} cannot embed "
                                  f"codebook {i} of {tok.codebook_sizes[i]} codes ({TOKENIZER_DIR}/config.json)")
    # Segments are encoded alone and their codes concatenated before grouping (vLLM
    # tokenize_audio_batch); per-segment grouping is the same only if a full segment's code count
    # is a multiple of the group size (6000 mel frames -> 1500 codes -> 375 groups, published).
    full = tok.code_frames(enc.audio_segment_size)
    if full % enc.group_size:
        raise CheckpointError(f"{where}: audio_segment_size {enc.audio_segment_size} gives {full} codes, "
                              f"not a multiple of group_size {enc.group_size}")
    if lm_hidden is not None and enc.out_hidden_size != lm_hidden:
        raise CheckpointError(f"{where}: out_hidden_size {enc.out_hidden_size} != the LM hidden_size {lm_hidden}")
