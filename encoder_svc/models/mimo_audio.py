"""MiMo-V2.5 omni audio tower: log-mel -> RVQ codes -> code embeddings -> LM-space tokens.

Our own implementation of what vLLM 0.32 runs (``model_executor/models/mimo_audio.py``:
``AudioEncoder`` of the MiMo-Audio-Tokenizer, ``tokenize_audio_batch``, ``MimoAudioEncoder``;
ported there from SGLang, tokenizer from github.com/XiaomiMiMo/MiMo-Audio-Tokenizer). Configs and
file layout: ``mimo_audio_config``; reading and checking the weights: ``mimo_audio_weights``.

Where the embedding happens: the checkpoint's own ``speech_embeddings`` + input local
transformer + projection turn codes into LM-space vectors, and they run HERE, so the LLM keeps
one rule for every modality: "embeddings at the pad positions" (vLLM does the same inside
``embed_multimodal``). The encoder service returns [num_tokens, lm_hidden], one row per
``<|audio_pad|>``.

Where the references disagree, this follows vLLM and the tokenizer's own code
(github.com/XiaomiMiMo/MiMo-Audio-Tokenizer passes ``causal=encoder_causal`` to flash-attn on
every layer): with ``encoder_causal`` the global (unwindowed) layers are causal too. SGLang's port
(``python/sglang/srt/models/mimo_audio.py``) builds them on ``VisionAttention``, which has no
causal flag, so there they see the whole segment. The windowed layers ((128, 0) as published:
the past 128 frames) agree in all three.

Batch items (``prepare``): one per ``audio_segment_size`` mel-frame segment (60 s), each encoded
alone as vLLM does (its own positions, attention only within the segment). An item is
``[n_mels + 1, L]``: the log-mel, zero past the segment's end, and a last row that is 1.0 on the
segment's frames (its length). Full segments have ``L = audio_segment_size``; the tail (or a
clip shorter than a segment) is its own group with ``L`` rounded up to a multiple of
``BUCKET_FRAMES``. Equal-``L`` items of many requests fuse in one forward; every
padded position is masked or zeroed so an item's output never depends on its batch neighbours
(vLLM's packed batch lets an odd-length segment's last conv/pool frame see a neighbour's
padding; alone, as here, it sees zeros).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from encoder_svc.errors import BadMedia
from encoder_svc.models.audio_items import AudioItems
from encoder_svc.models.mimo_audio_config import AudioEncoderConfig, AudioTokenizerConfig
from encoder_svc.preprocess.mimo_mel import log_mel

BUCKET_FRAMES = 500  # a clip's tail (or a short clip) pads to a multiple of 5 s: similar lengths share batches


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(n: int, dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rope tables [n, dim] for positions 0..n-1 (computed in float32, as both references)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, h, -1).transpose(1, 2)  # [B, h, T, hd]


# ---- tokenizer encoder (names as in audio_tokenizer/model.safetensors, less "encoder.") ----------


class _TokAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x, mask, cos, sin):  # x [B, T, d], mask [B, 1, T, T] bool (True = attend)
        q, k, v = (_heads(p(x), self.heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, T, hd]
        return self.out_proj(y.transpose(1, 2).flatten(2))


class _TokLayer(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = _TokAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, mask, cos, sin):
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask, cos, sin)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class _Codebook(nn.Module):
    def __init__(self, size: int, d: int):
        super().__init__()
        self.register_buffer("embed", torch.zeros(size, d))


def attention_mask(n: torch.Tensor, t: int, window: tuple[int, int], causal: bool) -> torch.Tensor:
    """flash-attn ``varlen`` semantics per segment of length ``n`` [B] -> [B, 1, t, t] bool.

    Query i sees key j when j < n, ``i - left <= j`` (left >= 0), ``j <= i + right`` (right >= 0),
    and ``j <= i`` when causal. A padded query row (i >= n) sees only itself: finite garbage that
    is never read, instead of a NaN that 0-weight attention would still spread.
    """
    i = torch.arange(t, device=n.device)[:, None]
    j = torch.arange(t, device=n.device)[None, :]
    ok = torch.ones(t, t, dtype=torch.bool, device=n.device)
    left, right = window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if causal:
        ok &= j <= i
    keys = j[None] < n[:, None, None]  # [B, 1, t]
    pad_q = (i[None] >= n[:, None, None]) & (i == j)[None]
    return ((ok[None] & keys) | pad_q)[:, None]


class AudioTokenizerEncoder(nn.Module):
    """log-mel [B, n_mels, L] + lengths -> RVQ codes [B, T, channels] + code lengths [B]."""

    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.n_mels, d, cfg.kernel_size, padding=1)
        self.conv2 = nn.Conv1d(d, d, cfg.kernel_size, stride=cfg.stride_size, padding=1)
        self.layers = nn.ModuleList(_TokLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        if cfg.avg_pooler != 1:
            self.down_sample_layer = nn.Sequential(
                nn.Conv1d(d, d, cfg.avg_pooler, cfg.avg_pooler, bias=False), nn.GELU())
            self.down_sample_norm = nn.LayerNorm(d)
        self.codebooks = nn.ModuleList(_Codebook(s, d) for s in cfg.codebook_sizes)

    def features(self, mel: torch.Tensor, mel_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        dt = self.conv1.weight.dtype
        frames = torch.arange(mel.shape[-1], device=mel.device)
        mel = mel * (frames < mel_len[:, None])[:, None]
        h = F.gelu(self.conv1(mel.to(dt)))  # [B, d, L]
        # past the segment conv1 would emit gelu(bias): zero it, as the lone segment's padding
        h = h * (frames < mel_len[:, None])[:, None]
        h = F.gelu(self.conv2(h)).transpose(1, 2)  # [B, T, d]
        n = (mel_len + 3 - cfg.kernel_size + 2 - cfg.kernel_size).div(cfg.stride_size, rounding_mode="floor") + 1
        t = h.shape[1]
        cos, sin = _rope(t, cfg.head_dim, cfg.rope_theta, h.device, h.dtype)
        masks = {w: attention_mask(n, t, w, cfg.encoder_causal)
                 for w in {cfg.layer_window(i) for i in range(cfg.encoder_layers)}}
        skip = None
        for i, layer in enumerate(self.layers):
            h = layer(h, masks[cfg.layer_window(i)], cos, sin)
            if cfg.encoder_skip_layer_id is not None and i == cfg.encoder_skip_layer_id - 1:
                skip = h
        h = self.layer_norm(h if skip is None else h + skip)
        if cfg.avg_pooler != 1:
            p = cfg.avg_pooler
            h = h * (torch.arange(t, device=h.device) < n[:, None])[..., None]  # zero-pad like a lone segment
            h = F.pad(h, (0, 0, 0, (-t) % p))
            h = self.down_sample_norm(self.down_sample_layer(h.transpose(1, 2)).transpose(1, 2))
            n = (n + p - 1).div(p, rounding_mode="floor")
        return h, n  # [B, T', d], [B]

    def quantize(self, h: torch.Tensor, channels: int) -> torch.Tensor:
        """Residual VQ in float32 (vLLM casts the quantizer to float32): [B, T, d] -> [B, T, channels].

        Only the first ``channels`` levels are computed: level q depends on levels < q only."""
        r = h.float().flatten(0, 1)  # [B*T, d]
        codes = []
        for book in self.codebooks[:channels]:
            e = book.embed.float()  # [K, d]
            dist = -(r.pow(2).sum(1, keepdim=True) - 2 * r @ e.t() + e.t().pow(2).sum(0, keepdim=True))
            idx = dist.max(dim=-1).indices
            r = r - F.embedding(idx, e)
            codes.append(idx)
        return torch.stack(codes, -1).view(*h.shape[:2], channels)


# ---- code embeddings + input local transformer + projection (config.json audio_config) ---------


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):  # transformers Qwen2RMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _LocalAttention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):  # x [N, g, d]: each group attends within itself
        q, k, v = (_heads(p(x), self.heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class _MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _LocalLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        d = cfg.input_local_dim
        self.input_layernorm = _RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = _LocalAttention(d, cfg.input_local_attn_heads, not cfg.input_full_attention)
        self.post_attention_layernorm = _RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = _MLP(d, cfg.input_local_intermediate_size)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class InputLocalTransformer(nn.Module):
    """transformers' ``Qwen2Model`` as vLLM calls it (``inputs_embeds``, positions 0..g-1)."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(_LocalLayer(cfg) for _ in range(cfg.input_local_layers))
        self.norm = _RMSNorm(cfg.input_local_dim, cfg.rms_norm_eps) if cfg.add_post_norm else nn.Identity()

    def forward(self, x):  # [N, g, d]
        cos, sin = _rope(x.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class _Projection2(nn.Module):
    def __init__(self, din: int, dout: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(din, 4 * din, bias=False), nn.GELU(), nn.Linear(4 * din, dout, bias=False))

    def forward(self, x):
        return self.mlp(x)


class MiMoAudioTower(nn.Module):
    """The whole audio side; ``forward`` [B, n_mels + 1, L] -> [B, G, out_hidden] (G for L)."""

    def __init__(self, enc: AudioEncoderConfig, tok: AudioTokenizerConfig):
        super().__init__()
        self.enc_cfg, self.tok_cfg = enc, tok
        self.tokenizer = AudioTokenizerEncoder(tok)
        d = enc.input_local_dim
        self.speech_embeddings = nn.ModuleList(nn.Embedding(v, d) for v in enc.speech_vocab_sizes)
        self.input_local_transformer = InputLocalTransformer(enc)
        din = d * enc.group_size
        self.projection = (nn.Linear(din, enc.out_hidden_size, bias=False) if enc.projection_layers == 1
                           else _Projection2(din, enc.out_hidden_size))
        self.sample_rate = tok.sampling_rate
        self.hidden_size = enc.out_hidden_size
        self.weight_dirs: list = []  # the loader fills in the directories it read (cache fingerprint)

    def cache_signature(self) -> str:
        t, e = self.tok_cfg, self.enc_cfg
        return (f"mimo_aud:{t.sampling_rate}:{t.n_mels}:{t.nfft}:{t.window_size}:{t.hop_length}:"
                f"{t.fmin}:{t.fmax}:{e.audio_segment_size}")

    def prepare(self, wave: torch.Tensor) -> AudioItems:
        """[n] mono samples at ``sample_rate`` (n > nfft / 2) -> the segments' batch items."""
        t, seg = self.tok_cfg, self.enc_cfg.audio_segment_size
        if wave.numel() <= t.nfft // 2:  # the centred STFT reflects n_fft / 2 samples at each end
            raise BadMedia(f"the audio is {1000 * wave.numel() / t.sampling_rate:.0f} ms long; "
                           f"send at least {1000 * (t.nfft // 2 + 1) / t.sampling_rate:.0f} ms")
        mel = log_mel(wave, sr=t.sampling_rate, n_fft=t.nfft, win_length=t.window_size, hop=t.hop_length,
                      n_mels=t.n_mels, fmin=t.fmin, fmax=t.fmax)  # [n_mels, frames]
        full, tail = divmod(mel.shape[1], seg)
        groups = [self._items(mel, 0, [seg] * full, seg)] if full else []
        if tail:  # the tail (or the whole clip) alone, padded to a 5 s multiple
            groups.append(self._items(mel, full * seg, [tail], min(seg, math.ceil(tail / BUCKET_FRAMES) * BUCKET_FRAMES)))
        return AudioItems(groups, [self.num_tokens(n) for n in [seg] * full + ([tail] if tail else [])])

    def _items(self, mel: torch.Tensor, start: int, lens: list[int], width: int) -> torch.Tensor:
        """[n_mels, frames] -> [len(lens), n_mels + 1, width]: consecutive segments from ``start``."""
        x = mel.new_zeros(len(lens), mel.shape[0] + 1, width)
        for k, n in enumerate(lens):
            x[k, :-1, :n] = mel[:, start : start + n]
            x[k, -1, :n] = 1.0
            start += n
        return x

    def num_tokens(self, mel_len: int) -> int:
        return math.ceil(self.tok_cfg.code_frames(mel_len) / self.enc_cfg.group_size)

    def embed_codes(self, codes: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """codes [B, T, C] with n [B] valid frames -> [B, ceil(T / g), out_hidden]."""
        b, t, c = codes.shape
        g = self.enc_cfg.group_size
        groups = math.ceil(t / g)
        # past its end an item repeats its last code (vLLM MimoAudioEncoder.process_audio)
        idx = torch.minimum(torch.arange(groups * g, device=codes.device)[None], (n - 1)[:, None])
        codes = codes.gather(1, idx[..., None].expand(-1, -1, c)).view(b * groups, g, c)
        x = self.speech_embeddings[0](codes[..., 0])
        for i in range(1, c):
            x = x + self.speech_embeddings[i](codes[..., i])
        x = self.input_local_transformer(x)  # [b * groups, g, d]
        return self.projection(x.reshape(b * groups, -1)).view(b, groups, -1)

    def check_integrity(self) -> None:
        """Structure the configs promise (raises AssertionError): one embedding table per channel
        covering its codebook, float32 codebooks of the configured sizes, a group-aligned segment."""
        e, t = self.enc_cfg, self.tok_cfg
        assert len(self.speech_embeddings) == e.audio_channels <= len(self.tokenizer.codebooks) == t.num_quantizers
        for c, book in enumerate(self.tokenizer.codebooks):
            assert book.embed.dtype == torch.float32 and tuple(book.embed.shape) == (t.codebook_sizes[c], t.d_model)
            if c < e.audio_channels:
                assert self.speech_embeddings[c].num_embeddings >= t.codebook_sizes[c], c
        assert len(self.tokenizer.layers) == t.encoder_layers
        assert len(self.input_local_transformer.layers) == e.input_local_layers
        assert t.code_frames(e.audio_segment_size) % e.group_size == 0

    @torch.inference_mode()
    def codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Items [B, n_mels + 1, L] -> codes [B, T, audio_channels] (int64) and lengths [B]."""
        mel_len = (x[:, -1] > 0.5).sum(-1)
        h, n = self.tokenizer.features(x[:, :-1], mel_len)
        return self.tokenizer.quantize(h, self.enc_cfg.audio_channels), n

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes, n = self.codes(x)
        return self.embed_codes(codes, n)
