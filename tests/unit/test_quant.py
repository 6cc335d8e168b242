"""Load-time dequantizers (``llm_svc/models/quant.py``) against independent references, the fused
QKV split against a head-by-head reference, and the config refusals."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from llm_svc.models.mimo_native import split_fused_qkv
from llm_svc.models.quant import Fp8Block, Mxfp4, dequant_fp8_block, dequant_mxfp4, scheme_for
from shared.bundle import CheckpointError
from mmserve.tiny.quantize import quantize_fp8_block, quantize_mxfp4

pytestmark = pytest.mark.unit


def test_mxfp4_nibble_order_and_e8m0_scale():
    # byte 0x2F: low nibble 0xF = -6.0 (element 0), high nibble 0x2 = +1.0 (element 1); scale 2**(125-127)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F
    out = dequant_mxfp4(blocks, torch.tensor([[125]], dtype=torch.uint8))
    assert out.shape == (1, 32)
    assert out[0, :3].tolist() == [-1.5, 0.25, 0.0]


def test_mxfp4_matches_transformers_dequantize():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 134, (3, 24, 4), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequant_mxfp4(blocks, scales).transpose(1, 2), ref)


def test_mxfp4_writer_round_trip_is_within_one_fp4_step():
    w = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)
    back = dequant_mxfp4(blocks, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)  # one unit of the group's scale
    assert ((back - w).abs() <= step + 1e-6).all()


def _fp8_reference(w, s, block, chunks):
    """Element by element: each chunk of rows has its own scale rows."""
    bo, bi = block
    rows = w.shape[0] // chunks
    per = -(-rows // bo)
    out = torch.empty(w.shape)
    for r in range(w.shape[0]):
        c, rr = divmod(r, rows)
        for col in range(w.shape[1]):
            out[r, col] = w[r, col].float() * s[c * per + rr // bo, col // bi]
    return out


@pytest.mark.parametrize("rows, chunks", [(2 * 112, 2), (300, 1)])
def test_fp8_block_dequant_matches_reference(rows, chunks):
    w = torch.randn(rows, 160, generator=torch.Generator().manual_seed(2))
    q, s = quantize_fp8_block(w, (128, 128), chunks)
    assert s.shape == (chunks * -(-rows // chunks // 128), 2)
    got = dequant_fp8_block(q, s, (128, 128), chunks)
    assert torch.equal(got, _fp8_reference(q, s, (128, 128), chunks))
    assert float((got - w).abs().max()) < 0.07 * float(w.abs().max())


def test_fp8_continuous_scale_grid_is_read_for_chunked_rows():
    w = torch.randn(256, 128)
    q, s = quantize_fp8_block(w)  # one grid: 2 scale rows, also valid for 2 chunks of 128 rows
    assert torch.equal(dequant_fp8_block(q, s, (128, 128), row_groups=4), dequant_fp8_block(q, s, (128, 128)))


def test_fp8_bad_scale_shape_is_named():
    q, _ = quantize_fp8_block(torch.randn(224, 128), row_groups=2)
    with pytest.raises(ValueError, match=r"'w.weight_scale_inv': scale has shape \[3, 1\].*\[2, 1\] or \[2, 1\]"):
        dequant_fp8_block(q, torch.ones(3, 1), (128, 128), 2, "'w.weight_scale_inv'")


def test_split_fused_qkv_restores_head_order():
    heads, kv, dq, dv, chunks = 8, 4, 3, 2, 2
    q, k, v = torch.randn(heads * dq, 5), torch.randn(kv * dq, 5), torch.randn(kv * dv, 5)
    rows = []  # chunk c: its Q heads, its K heads, its V heads, head by head
    for c in range(chunks):
        rows += [q[h * dq:(h + 1) * dq] for h in range(c * heads // chunks, (c + 1) * heads // chunks)]
        rows += [k[h * dq:(h + 1) * dq] for h in range(c * kv // chunks, (c + 1) * kv // chunks)]
        rows += [v[h * dv:(h + 1) * dv] for h in range(c * kv // chunks, (c + 1) * kv // chunks)]
    got = split_fused_qkv(torch.cat(rows), heads, kv, dq, dv, chunks)
    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v), strict=True))
    with pytest.raises(ValueError, match="not 2 chunks"):
        split_fused_qkv(torch.cat(rows)[:-1], heads, kv, dq, dv, chunks)


def test_scheme_for_reads_the_published_configs(tmp_path):
    fp8 = scheme_for({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                      "weight_block_size": [128, 128]}, tmp_path / "config.json")
    assert isinstance(fp8, Fp8Block) and fp8.block == (128, 128)
    mx = scheme_for({"modules_to_not_convert": ["lm_head"], "quant_method": "mxfp4"}, tmp_path / "config.json")
    assert isinstance(mx, Mxfp4)
    assert scheme_for(None) is None and scheme_for({}) is None


@pytest.mark.parametrize("q, allowed, match", [
    ({"quant_method": "awq"}, None, r"field 'quantization_config.quant_method' = 'awq' is not supported"),
    ({"quant_method": "mxfp4"}, ("fp8",), r"field 'quantization_config.quant_method' = 'mxfp4' is not supported for this model .*\['fp8'\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "store_dtype": "mxfp4"}, None,
     r"field 'quantization_config.store_dtype' is not understood"),
    ({"quant_method": "fp8"}, None, r"field 'quantization_config.weight_block_size' = None must be two positive ints"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, None,
     r"field 'quantization_config.activation_scheme' = 'static' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, None, r"field 'quantization_config.fmt'"),
])
def test_scheme_refusals_name_the_file_and_field(tmp_path, q, allowed, match):
    with pytest.raises(CheckpointError, match=str(tmp_path / "config.json").replace(".", r"\.") + ": " + match):
        scheme_for(q, tmp_path / "config.json", allowed=allowed)
