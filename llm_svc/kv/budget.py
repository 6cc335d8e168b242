"""KV geometry of a hybrid SWA model and the split of one byte budget into the two pools.

Default split rule (``swa_fraction=None``)
------------------------------------------
Every sequence, live or cached in the prefix tree, needs full KV for all its tokens but SWA KV
only for its last ``W`` tokens (plus the tokens written since the last release: up to
``release_interval`` decode tokens). The full pool holds about ``S = num_full / expected_seq_len``
sequences of typical length, so the SWA pool gets ``S * (W + release_interval)`` slots, plus one
prefill chunk with its window (``W + max_chunk``) in flight, plus one more window for each of
``max_running`` running requests (the pinned window of its cached prefix, or the window it keeps
at a branch point; 0 when the prefix cache is off). Solving
``kv_bytes = num_full * full_token_bytes + num_swa * swa_token_bytes`` gives both counts. With
``swa_fraction`` set, that fraction of the bytes goes to the SWA pool instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVGeometry:
    """Per-token KV sizes: K has ``qk_head_dim`` and V ``v_head_dim`` per KV head, per layer.
    ``swa_kv_heads`` (0 = ``kv_heads``) covers models whose sliding layers have other head counts."""

    full_layers: int
    swa_layers: int
    window: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    dtype_bytes: int = 2
    swa_kv_heads: int = 0

    def __post_init__(self) -> None:
        if self.full_layers < 1 or self.swa_layers < 1:
            raise ValueError("a hybrid SWA geometry needs >= 1 full and >= 1 sliding layer")
        for name in ("window", "kv_heads", "qk_head_dim", "v_head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVGeometry.{name} must be >= 1")
        if self.swa_kv_heads < 0:
            raise ValueError("KVGeometry.swa_kv_heads must be >= 0")

    @property
    def layer_token_bytes(self) -> int:
        """K + V bytes of one token in one layer."""
        return self.kv_heads * (self.qk_head_dim + self.v_head_dim) * self.dtype_bytes

    @property
    def full_token_bytes(self) -> int:
        """Bytes of one full-pool slot (all full-attention layers)."""
        return self.full_layers * self.layer_token_bytes

    @property
    def swa_token_bytes(self) -> int:
        """Bytes of one SWA-pool slot (all sliding layers)."""
        heads = self.swa_kv_heads or self.kv_heads
        return self.swa_layers * heads * (self.qk_head_dim + self.v_head_dim) * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: Any, dtype_bytes: int = 2) -> "KVGeometry":
        """From a transformers config with ``layer_types`` (MiMo-V2, Gemma 3 or its text_config).

        MiMo-V2's sliding layers have twice the KV heads of its full layers (transformers'
        ``MiMoV2FlashAttention``; a ``swa_num_key_value_heads`` field, if present, wins)."""
        cfg = getattr(config, "text_config", None) or config
        types = list(cfg.layer_types)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = int(cfg.num_key_value_heads)
        swa_kv_heads = getattr(cfg, "swa_num_key_value_heads", None)
        if swa_kv_heads is None and str(getattr(cfg, "model_type", "")).startswith("mimo_v2"):
            swa_kv_heads = 2 * kv_heads
        return cls(
            full_layers=sum(t == "full_attention" for t in types),
            swa_layers=sum(t == "sliding_attention" for t in types),
            window=int(cfg.sliding_window),
            kv_heads=kv_heads,
            qk_head_dim=int(head_dim),
            v_head_dim=int(getattr(cfg, "v_head_dim", None) or head_dim),
            dtype_bytes=dtype_bytes,
            swa_kv_heads=int(swa_kv_heads or 0),
        )


def size_pools(
    kv_bytes: int,
    geometry: KVGeometry,
    swa_fraction: float | None = None,
    *,
    max_chunk: int = 512,
    expected_seq_len: int = 4096,
    release_interval: int = 16,
    max_running: int = 0,
) -> tuple[int, int]:
    """``(num_full_slots, num_swa_slots)`` that fit in ``kv_bytes`` (rule in the module doc).

    Reads only ``full_token_bytes``, ``swa_token_bytes`` and ``window`` of ``geometry``."""
    fb, sb, w = geometry.full_token_bytes, geometry.swa_token_bytes, geometry.window
    if swa_fraction is not None:
        if not 0.0 < swa_fraction < 1.0:
            raise ValueError(f"swa_fraction must be in (0, 1), got {swa_fraction}")
        num_full = int(kv_bytes * (1.0 - swa_fraction)) // fb
        num_swa = int(kv_bytes * swa_fraction) // sb
    else:
        if expected_seq_len < 1 or max_chunk < 1 or release_interval < 1:
            raise ValueError("expected_seq_len, max_chunk and release_interval must be >= 1")
        per_full = (w + release_interval) / expected_seq_len  # SWA slots per full slot
        fixed = w + max_chunk + max_running * w
        num_full = int((kv_bytes - fixed * sb) / (fb + per_full * sb))
        num_swa = (kv_bytes - num_full * fb) // sb if num_full > 0 else 0
    if num_full < 1 or num_swa < 1:
        raise ValueError(
            f"kv_bytes={kv_bytes} too small: {num_full} full / {num_swa} SWA slots "
            f"({fb} / {sb} bytes per slot)"
        )
    return num_full, num_swa
