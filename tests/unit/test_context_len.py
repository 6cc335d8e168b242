"""The default max_model_len is the checkpoint's context length, derived as vLLM derives it."""

from __future__ import annotations

import pytest

from llm_svc.loading.context_len import DEFAULT_CONTEXT_LEN, context_length

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("raw, tokenizer_max, expected", [
    ({"max_position_embeddings": 32768}, None, 32768),
    ({"n_positions": 1024}, None, 1024),  # GPT-2
    ({"max_position_embeddings": 8192, "seq_length": 4096}, None, 4096),  # the smallest field
    ({"max_position_embeddings": 8192, "model_max_length": 16384}, None, 16384),  # Command-R's wins
    ({"max_position_embeddings": 32768}, 8192, 8192),  # tokenizer_config.json's model_max_length
    ({"max_position_embeddings": 32768}, int(1e30), 32768),  # transformers' "unset"
    ({"text_config": {"max_position_embeddings": 65536}, "max_position_embeddings": 1024}, None, 65536),
    ({"llm_config": {"max_position_embeddings": 40960}}, None, 40960),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, None, 16384),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None, 8192),
    # YaRN, Llama 3, LongRoPE: the field is already the scaled length (gpt-oss: 131072)
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                                          "original_max_position_embeddings": 4096}}, None, 131072),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, None, 131072),
    # per-layer-type RoPE parameters (transformers 5)
    ({"max_position_embeddings": 4096, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0},
                                                           "sliding_attention": {"rope_type": "default"}}}, None, 8192),
    # Gemma 3's field is already scaled
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "max_position_embeddings": 131072,
                                              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}}, None, 131072),
    ({"hidden_size": 64}, None, DEFAULT_CONTEXT_LEN),  # none of the fields: vLLM's 2048
    ({"hidden_size": 64}, 4096, 4096),
])
def test_context_length_follows_vllm(raw, tokenizer_max, expected):
    assert context_length(raw, tokenizer_max) == expected


def test_the_tiny_bundles_report_their_config(mimo_bundle):
    from llm_svc.loading.loader import load_lm

    assert load_lm(str(mimo_bundle), weights=False).context_len == 8192  # its max_position_embeddings
