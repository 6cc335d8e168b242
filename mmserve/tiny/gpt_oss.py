"""Tiny gpt-oss checkpoint (``--arch gpt-oss``) in the layout of openai/gpt-oss-20b's
``config.json`` (https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json: ``rope_theta`` +
YaRN ``rope_scaling``, ``experts_per_token``, ``initial_context_length``, ``swiglu_limit``,
``layer_types`` sliding/full alternating from a sliding layer, ``attention_bias``) with the
dequantized (bf16-style, unpacked) expert tensors ``mlp.experts.{gate_up_proj,down_proj}[_bias]``.

The hub's weights pack the experts in MXFP4 (``*_blocks`` / ``*_scales`` uint8 and
``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``, as in
openai/gpt-oss-20b's config.json); ``quant="mxfp4"`` writes that form of the same random weights
(blocks ``[E, out, in/32, 16]``: the experts' ``[E, in, out]`` tensors transposed, as
transformers' ``integrations/mxfp4.py`` reads them back).
The tokenizer is a small byte-level BPE with the harmony special tokens (``<|start|>``,
``<|message|>``, ``<|end|>``, ``<|return|>``...) and a reduced harmony chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                    "<|call|>", "<|constrain|>"]
# gpt-oss' tool rendering (harmony): the tools as TypeScript-like signatures in namespace
# ``functions`` in a developer message, an assistant's ``reasoning_content`` in its analysis
# channel, its calls as ``commentary to=functions.NAME <|constrain|>json`` messages ending in
# ``<|call|>``, a tool result as a message from ``functions.NAME`` to the assistant. Without
# tools, tool calls, tool messages or reasoning_content the template renders as before.
HARMONY_TOOLS = (
    "{% if tools %}{{ '<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n' }}"
    "{% for tool in tools %}{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{% if fn['description'] %}{{ '// ' + fn['description'] + '\n' }}{% endif %}"
    "{{ 'type ' + fn['name'] + ' = (' }}{% if fn['parameters'] %}{{ '_: ' + (fn['parameters'] | tojson) }}{% endif %}"
    "{{ ') => any;\n\n' }}{% endfor %}{{ '} // namespace functions<|end|>' }}{% endif %}"
)
HARMONY_TOOL_CALLS = (
    "{% for call in message['tool_calls'] %}{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% set ns.last_call = fn['name'] %}"
    "{{ '<|start|>assistant<|channel|>commentary to=functions.' + fn['name'] + ' <|constrain|>json<|message|>' }}"
    "{{ fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}{{ '<|call|>' }}{% endfor %}"
)
HARMONY_TEMPLATE = (
    "{% set ns = namespace(last_call='') %}" + HARMONY_TOOLS
    + "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|start|>functions.' + (message['name'] if message['name'] is string else ns.last_call) }}"
    "{{ ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{ message['content'] if message['content'] is string else '' }}{{ '<|end|>' }}"
    "{% else %}"
    "{% if message['role'] == 'assistant' and message['reasoning_content'] is string %}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + message['reasoning_content'] + '<|end|>' }}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% if message['content'] %}{{ '<|start|>assistant<|channel|>commentary<|message|>' + message['content'] + '<|end|>' }}"
    "{% endif %}" + HARMONY_TOOL_CALLS + "{% else %}"
    "{{ '<|start|>' + message['role'] + '<|message|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant<|channel|>final<|message|>' }}{% endif %}"
)


MXFP4_QUANT_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                              "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def pack_experts_mxfp4(model_dir: Path) -> None:
    """Rewrite ``model_dir``'s expert tensors ``mlp.experts.{gate_up_proj,down_proj}`` (``[E, in, out]``)
    as ``*_blocks`` / ``*_scales`` and add the hub's ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    from mmserve.tiny.quantize import quantize_mxfp4

    f = model_dir / "model.safetensors"
    state = load_file(str(f))
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(name).transpose(1, 2))  # [E, out, in] rows
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, str(f), metadata={"format": "pt"})
    c = json.loads((model_dir / "config.json").read_text())
    c["quantization_config"] = dict(MXFP4_QUANT_CONFIG)
    (model_dir / "config.json").write_text(json.dumps(c, indent=2))


def write_gpt_oss(out: Path, sliding_window: int = 128, seed: int = 0, head_dim: int = 32,
                  quant: str | None = None, hidden: int = 128, intermediate: int = 128, experts: int = 4,
                  layers: int = 6) -> Path:
    """Write a tiny random-weight ``GptOssForCausalLM`` checkpoint to ``out`` (``quant="mxfp4"``:
    experts packed as on the hub; ``hidden`` / ``intermediate`` multiples of 32 there). ``layers``
    (even) alternate sliding / full; the sizes' defaults are the tiny model's."""
    if layers < 2 or layers % 2:
        raise ValueError(f"gpt-oss layers alternate sliding / full: an even count, got {layers}")
    if quant not in (None, "mxfp4"):
        raise ValueError(f"gpt-oss quant must be None or 'mxfp4', got {quant!r}")
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from mmserve.tiny.tokenizer import build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer(HARMONY_SPECIALS, 640, HARMONY_TEMPLATE, eos="<|return|>", pad_token="<|endoftext|>")
    eos, pad = tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    layer_types = ["sliding_attention", "full_attention"] * (layers // 2)
    rope_scaling = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                    "rope_type": "yarn", "truncate": False}
    cfg = GptOssConfig(
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=len(layer_types), layer_types=layer_types, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=2, sliding_window=sliding_window,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 150000.0, **rope_scaling}, eos_token_id=eos, pad_token_id=pad,
        attention_bias=True, tie_word_embeddings=False)
    cfg.architectures = ["GptOssForCausalLM"]
    model = GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the 0.02 init makes a tiny random model repeat one token
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks") or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "experts" in name:  # [E, in, out]
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-2] ** -0.5)
            else:  # [out, in]
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # the published key set: legacy rope fields and gpt-oss' own names next to transformers' ones
    c = json.loads((out / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    c.update(experts_per_token=c["num_experts_per_tok"], initial_context_length=4096, swiglu_limit=7.0,
             router_aux_loss_coef=0.9)
    (out / "config.json").write_text(json.dumps(c, indent=2))
    if quant == "mxfp4":
        pack_experts_mxfp4(out)
    return out
