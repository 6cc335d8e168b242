"""A checkpoint's context length: the default ``max_model_len``, derived as vLLM derives it.

The text config's smallest length field (``max_position_embeddings``, GPT-2's ``n_positions``,
...; ``model_max_length`` wins where present), at most the tokenizer's ``model_max_length``,
times the RoPE scaling factor of the types whose length field is the unscaled one (linear,
dynamic; not YaRN, Llama 3, LongRoPE, whose field is already scaled, nor Gemma 3's). A config
with none of the fields gets vLLM's 2048.
"""

from __future__ import annotations

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
DEFAULT_CONTEXT_LEN = 2048
_UNSET = 1 << 60  # transformers' model_max_length when tokenizer_config.json has none is ~1e30


def context_length(raw: dict, tokenizer_max: int | None = None) -> int:
    """The context length of a checkpoint whose ``config.json`` is ``raw``."""
    text = next((raw[k] for k in TEXT_CONFIG_KEYS if isinstance(raw.get(k), dict)), raw)
    found = [v for k in LENGTH_KEYS if isinstance(v := text.get(k), int) and not isinstance(v, bool)]
    n = text["model_max_length"] if isinstance(text.get("model_max_length"), int) else min(found, default=None)
    if tokenizer_max is not None and tokenizer_max < _UNSET:
        n = tokenizer_max if n is None else min(n, tokenizer_max)
    if n is None:
        return DEFAULT_CONTEXT_LEN
    model_type = str(text.get("model_type") or raw.get("model_type") or "")
    if "gemma3" not in model_type:
        n *= _rope_factor(text.get("rope_scaling") or text.get("rope_parameters"))
    return int(n)


def _rope_factor(rope) -> float:
    """The scaling factor that multiplies the length field (1 for the types already scaled)."""
    if not isinstance(rope, dict):
        return 1.0
    per_layer = [v for v in rope.values() if isinstance(v, dict)]  # {"full_attention": {...}, ...}
    factor = 1.0
    for params in per_layer or [rope]:
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in SCALED_ALREADY and params.get("factor") is not None:
            factor = float(params["factor"])
    return factor
