"""vLLM 0.32 as the second oracle for the fused FP8 ``qkv_proj`` layout: its own de-interleave
and dequantization (``scripts/vllm_fused_qkv.py``) gives bitwise the q/k/v mmserve loads.

vLLM's CPU build cannot run these checkpoints end to end (seen here: FP8 and MXFP4 refuse
float32, and in bfloat16 find no CPU kernel: "Failed to find a kernel that can implement the
ScaledMM linear layer" / "No MXFP4 MoE backend supports the deployment configuration"), so the
end-to-end oracles of the quantized forms are transformers' (test_quantized_checkpoints.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llm_svc.loading.loader import load_lm
from mmserve.tiny import mimo_published as mp
from tests.conftest import SMALL_W
from tests.integration.test_vllm_oracle import vllm_python  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
SPECS = {
    "v2.5": mp.V25,  # 2 chunks; full and sliding layers 2 KV heads each
    "v2.5-pro-like": replace(mp.V25, kv_heads=2, swa_kv_heads=4),  # sliding layers: 2 KV heads per chunk
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_fp8_qkv_matches_vllms_own_reading(name, vllm_python, tmp_path):  # noqa: F811
    d = mp.write_mimo_published(tmp_path / name, SPECS[name], sliding_window=SMALL_W, layout="fused_qkv", quant="fp8")
    proc = subprocess.run([vllm_python, str(REPO / "scripts" / "vllm_fused_qkv.py"), str(d), str(tmp_path / "v.pt")],
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        pytest.fail(f"vLLM failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    ref = torch.load(tmp_path / "v.pt")
    sd = load_lm(str(d)).model.state_dict()
    assert len(ref) == len(SPECS[name].pattern)
    for layer, rows in ref.items():
        ours = torch.cat([sd[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(ours, rows), layer
    print(f"\n[vllm-oracle] mimo {name} fused fp8 qkv: {len(ref)}/{len(ref)} layers bitwise equal", file=sys.stderr)
