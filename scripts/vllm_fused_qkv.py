"""vLLM's own reading of a fused FP8 ``qkv_proj``: its ``_shard_fp8_qkv_proj`` (vLLM
``model_executor/models/mimo_v2.py``) at tp_size = 1, with the final re-quantization skipped, on
every layer of a checkpoint; saves ``{"model.layers.N": rows [Q | K | V] float32}``.

Runs under the vLLM venv's python (``bash scripts/vllm_venv.sh`` prints it); imports nothing of
mmserve. vLLM's CPU build has no FP8 kernel (and refuses float32 with FP8), so this is how its
layout code is checked on CPU.

    VENV_PY scripts/vllm_fused_qkv.py CHECKPOINT_DIR OUT.pt
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors import safe_open


def main(model_dir: str, out_path: str) -> int:
    import vllm.model_executor.models.mimo_v2 as mimo_v2

    # tp_size = 1 gathers every head, dequantizes with the chunk scales, then re-quantizes to fp8;
    # keep the dequantized rows instead (the re-quantization is vLLM's storage, not the layout)
    mimo_v2._requantize_fp8 = lambda grouped, rows, block, dtype: (grouped, None)
    cfg = json.load(open(f"{model_dir}/config.json"))
    block = cfg["quantization_config"]["weight_block_size"][0]
    out = {}
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        for i, kind in enumerate(cfg["hybrid_layer_pattern"]):
            p, name = ("swa_" if kind else ""), f"model.layers.{i}.self_attn.qkv_proj.weight"
            rows, _ = mimo_v2._shard_fp8_qkv_proj(
                f.get_tensor(name), f.get_tensor(name + "_scale_inv"), num_heads=cfg[p + "num_attention_heads"],
                num_kv_heads=cfg[p + "num_key_value_heads"], head_dim=cfg[p + "head_dim"],
                v_head_dim=cfg[p + "v_head_dim"], tp_rank=0, tp_size=1, ckpt_tp=cfg["num_key_value_heads"], block=block)
            out[f"model.layers.{i}"] = rows.float()
    torch.save(out, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
