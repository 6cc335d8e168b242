"""The Triton FP8 block-scaled GEMM (``llm_svc.models.triton_fp8``, the CUDA path of FP8
checkpoints) under Triton's interpreter on the CPU: against dequantize-then-matmul
(``quant.dequant_fp8_block``) on every tile tail (rows and columns not multiples of the tile,
K not a multiple of the scale block, a column tile straddling two scale rows), with a bias, in
float32 and bfloat16; and the routed experts against the dense per-expert loop, an expert with
no tokens included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_svc.models.quant import dequant_fp8_block
from llm_svc.models.triton_fp8 import check_block, fp8_block_experts, fp8_block_linear

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.02 + 0.001
    return w, s


@pytest.mark.parametrize("m,n,k,block", [
    (1, 64, 128, (128, 128)),      # one decode row, one tile
    (5, 130, 200, (128, 128)),     # N past a scale block, K a partial block
    (37, 96, 256, (32, 64)),       # a 64-column tile straddles two 32-row scale blocks
    (33, 7, 48, (128, 16)),        # N smaller than the tile, K three small blocks
])
def test_linear_equals_dequantized_matmul_float32(m, n, k, block):
    w, s = fp8_weight(n, k, block, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    got = fp8_block_linear(x, w, s, bias, block=block)
    want = F.linear(x.double(), dequant_fp8_block(w, s, block).double(), bias.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_linear_bfloat16_activations_and_leading_dims():
    block = (128, 128)
    w, s = fp8_weight(192, 320, block, seed=3)
    x = torch.randn(2, 9, 320).to(torch.bfloat16)
    got = fp8_block_linear(x, w, s, block=block)
    want = F.linear(x.double(), dequant_fp8_block(w, s, block).double())
    assert got.shape == (2, 9, 192) and got.dtype == torch.bfloat16
    # bfloat16 output rounding (8 bits of mantissa) on values of |y| up to ~10
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_row_chunked_scale_grid_through_scale_rows():
    """MiMo's fused qkv_proj: 3 row chunks of 80 rows, each with its own scale rows (a grid of
    3 x ceil(80/32) rows), and one chunk alone (a part of the fused weight)."""
    block, chunk, k = (32, 64), 80, 192
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(3 * chunk, k, generator=g) * 2).to(torch.float8_e4m3fn)
    per = -(-chunk // block[0])
    s = torch.rand(3 * per, -(-k // block[1]), generator=g) * 0.02 + 0.001
    r = torch.arange(3 * chunk)
    rows = ((r // chunk) * per + (r % chunk) // block[0]).to(torch.int32)
    x = torch.randn(9, k)
    want = F.linear(x.double(), dequant_fp8_block(w, s, block, row_groups=3).double())
    got = fp8_block_linear(x, w, s, block=block, scale_rows=rows)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    part = fp8_block_linear(x, w[chunk:2 * chunk], s, block=block, scale_rows=rows[chunk:2 * chunk])
    torch.testing.assert_close(part.double(), want[:, chunk:2 * chunk], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="scale_rows index past"):
        fp8_block_linear(x, w, s[:2], block=block, scale_rows=rows)


def test_empty_rows_and_bad_scale():
    w, s = fp8_weight(64, 128, (128, 128), seed=4)
    assert fp8_block_linear(torch.empty(0, 128), w, s).shape == (0, 64)
    with pytest.raises(ValueError, match="needs"):
        check_block(w, s[:, :0], (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_block(w.float(), s, (128, 128))


def test_experts_equal_dense_loop_with_an_idle_expert():
    block = (32, 32)
    e, h, inter, t, top = 4, 64, 48, 11, 2
    gu, gus = zip(*(fp8_weight(2 * inter, h, block, seed=10 + i) for i in range(e)))
    dn, dns = zip(*(fp8_weight(h, inter, block, seed=20 + i) for i in range(e)))
    gate_up, gate_up_scale = torch.stack(gu), torch.stack(gus)
    down, down_scale = torch.stack(dn), torch.stack(dns)
    x = torch.randn(t, h)
    idx = torch.randint(0, e - 1, (t, top))  # expert e - 1 gets no token
    wts = torch.rand(t, top)
    got = fp8_block_experts(x, idx, wts, gate_up, gate_up_scale, down, down_scale, block=block)
    want = torch.zeros(t, h, dtype=torch.float64)
    for i in range(t):
        for j in range(top):
            ex = int(idx[i, j])
            g = F.linear(x[i].double(), dequant_fp8_block(gate_up[ex], gate_up_scale[ex], block).double())
            a = F.silu(g[:inter]) * g[inter:]
            want[i] += wts[i, j].double() * F.linear(a, dequant_fp8_block(down[ex], down_scale[ex], block).double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
