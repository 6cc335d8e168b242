"""The packed kernels' weight formats (``cpu_packed`` builds per ``w_elem.h`` format, packed by
``qweight``): bfloat16, FP8 e4m3 with 128x128 block scales and MXFP4 weights equal
dequantize-then-matmul (``quant.dequant_*`` + a float64 matmul) on every tile tail (odd K, N not
a multiple of the tile, K not a multiple of 128: a partial scale block, a fused projection's
per-chunk scale grid, an expert with no tokens, one row and GEMM-sized row counts), on the
AVX-512 build and on the AVX2 one (compiled with ``-mno-avx512f``).

Tolerance: the widened weights are the dequantized ones bit for bit (the scale multiplies the
weight, w_elem.h), so the only difference is float32 accumulation: ``|got - want| <= 1e-5 *
max|want| + 1e-5 * |want|`` (float64 reference)."""

import pytest
import torch

from llm_svc.models import cpu_packed, qweight
from llm_svc.models.quant import dequant_fp8_block, dequant_mxfp4
from tests.moe_ref import moe_reference

pytestmark = pytest.mark.unit

AVX2 = cpu_packed.builds(("-mno-avx512f",), "_avx2")
BUILDS = {"native": cpu_packed.KERNELS, "avx2": AVX2}
FORMATS = ("bfloat16", "fp8", "mxfp4")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-6)


def _stored(fmt: str, n: int, k: int, seed: int, row_groups: int = 1):
    """A random stored weight of ``fmt`` ``[n, k]``: (pack()'s keyword arguments, the dequantized
    float32 weight). FP8 bytes cover every e4m3 code but NaN (subnormals and -0 included)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "bfloat16":
        w = torch.randn(n, k, generator=g).bfloat16()
        return {"w": w}, w.float()
    if fmt == "fp8":
        b = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        w = b.view(torch.float8_e4m3fn)
        chunk = n // row_groups
        srows = row_groups * -(-chunk // 128) if row_groups > 1 else -(-n // 128)
        s = torch.rand(srows, -(-k // 128), generator=g) * 0.02 + 1e-3
        return {"w": w, "scale": s, "row_groups": row_groups}, dequant_fp8_block(w, s, (128, 128), row_groups)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 131, (n, k // 32), generator=g, dtype=torch.uint8)
    return {"w": blocks, "scale": scales}, dequant_mxfp4(blocks, scales)


def test_every_format_builds_here_on_both_paths():
    for name, kernels in BUILDS.items():
        for fmt, k in kernels.items():
            assert k.available(), (name, fmt)  # CI has a compiler: a failed build must fail here
            assert k.load().mmserve_packed_format() == list(cpu_packed.FORMATS).index(fmt)
    assert AVX2["fp8"].load().mmserve_packed_vl() == 8


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_linear_equals_dequantize_then_matmul(build, fmt, rows):
    kernels = BUILDS[build]
    n = 77  # not a multiple of either build's tile (32, 16)
    k = 320 if fmt == "mxfp4" else 301  # odd K; 301 is 2 full 128-blocks and a partial one
    args, dense = _stored(fmt, n, k, seed=rows)
    pw = qweight.pack(fmt, kernels=kernels, **args)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 100))
    bias = torch.randn(n)
    want = x.double() @ dense.double().T + bias.double()
    one = cpu_packed.gemm(x, pw, bias, threads=1)
    _close(one, want)
    assert torch.equal(cpu_packed.gemm(x, pw, bias, threads=2), one)  # results do not depend on threads


@pytest.mark.parametrize("build", list(BUILDS))
def test_fp8_fused_projection_with_a_scale_grid_per_row_chunk(build):
    """MiMo's fused qkv_proj: 3 chunks of 80 rows, each with its own scale rows (80 is not a
    multiple of 128, so chunk 2's first rows use another scale row than the grid would say, and
    a tile straddles two scale rows)."""
    args, dense = _stored("fp8", 240, 256, seed=5, row_groups=3)
    assert args["scale"].shape == (3, 2)
    pw = qweight.pack("fp8", kernels=BUILDS[build], **args)
    x = torch.randn(4, 256)
    _close(cpu_packed.gemm(x, pw, threads=1), x.double() @ dense.double().T)


def test_packed_sizes_are_the_stored_widths():
    n, k = 256, 1024
    sizes = {fmt: qweight.pack(fmt, **_stored(fmt, n, k, seed=0)[0]).nbytes / (n * k) for fmt in FORMATS}
    assert sizes["bfloat16"] == 2
    assert 1 < sizes["fp8"] <= 1 + 4 / 128  # one float32 scale per column and 128-deep group
    assert sizes["mxfp4"] == 0.5 + 1 / 32


def test_float32_pack_is_the_c_pack():
    w = torch.randn(70, 33)
    pw = qweight.pack("float32", w)
    assert torch.equal(pw.data, cpu_packed.pack_linear(w))
    x = torch.randn(5, 33)
    assert torch.equal(cpu_packed.gemm(x, pw), cpu_packed.linear(x, cpu_packed.pack_linear(w), 70))


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_routed_experts_equal_dequantize_then_moe(build, fmt, tokens):
    """H 192 and I 160 (partial 128-blocks both ways), 5 experts, top 2, expert 3 never chosen;
    200 tokens take the prefill-sized row-group passes, 1 and 5 the column-block ones."""
    kernels = BUILDS[build]
    e, h, i, k = 5, 192, 160, 2
    assert qweight.experts_packable(fmt, h, i, kernels)
    stored = {n: [_stored(fmt, *shape, seed=10 * j + (n == "down")) for j in range(e)]
              for n, shape in (("gate_up", (2 * i, h)), ("down", (h, i)))}
    if fmt == "fp8":  # gate then up, each with its own grid (I = 160 is not a multiple of 128)
        for j in range(e):
            a = stored["gate_up"][j][0]
            gate, up = _stored("fp8", i, h, seed=1000 + j), _stored("fp8", i, h, seed=2000 + j)
            a.update(w=torch.cat((gate[0]["w"], up[0]["w"])), scale=torch.cat((gate[0]["scale"], up[0]["scale"])),
                     row_groups=2)
            stored["gate_up"][j] = (a, torch.cat((gate[1], up[1])))
    pe = qweight.pack_experts(e, lambda j: qweight.pack(fmt, kernels=kernels, **stored["gate_up"][j][0]),
                              lambda j: qweight.pack(fmt, kernels=kernels, **stored["down"][j][0]))
    gate_up = torch.stack([s[1] for s in stored["gate_up"]])
    down = torch.stack([s[1] for s in stored["down"]])
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=g) * 0.1
    idx = torch.stack([torch.tensor([0, 1, 2, 4])[torch.randperm(4, generator=g)[:k]] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    want = moe_reference(x, idx, w, gate_up, down)
    one = cpu_packed.moe_w(x, idx, w, pe, threads=1)
    _close(one, want)
    assert torch.equal(cpu_packed.moe_w(x, idx, w, pe, threads=2), one)
    with pytest.raises(ValueError, match="outside"):
        cpu_packed.moe_w(x, idx + e, w, pe)


@pytest.mark.parametrize("fmt", ("float32",) + FORMATS)
def test_packed_weights_unpack_join_and_reorder(fmt):
    """``dense`` gives back the dequantized weight; ``concat`` (q | k | v, gate | up) with a row
    order equals packing the joined stored rows in that order."""
    k = 320 if fmt == "mxfp4" else 301
    if fmt == "float32":
        parts = [({"w": w}, w) for w in (torch.randn(40, k), torch.randn(37, k))]
    else:
        parts = [_stored(fmt, n, k, seed=n) for n in (40, 37)]
    pws = [qweight.pack(fmt, **a) for a, _ in parts]
    for pw, (_, want) in zip(pws, parts):
        assert torch.equal(qweight.dense(pw), want)
    order = torch.randperm(77)
    joined = qweight.concat(pws, order)
    assert torch.equal(qweight.dense(joined), torch.cat([d for _, d in parts])[order])
    x = torch.randn(3, k)
    _close(cpu_packed.gemm(x, joined), x.double() @ torch.cat([d for _, d in parts])[order].double().T)


def test_fp8_scales_that_would_overflow_are_refused():
    args, _ = _stored("fp8", 32, 128, seed=0)
    args["scale"] = args["scale"] * 0 + 2.0 ** 121
    with pytest.raises(ValueError, match="2\\^120"):
        qweight.pack("fp8", **args)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("fmt", ("float32",) + FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 16, 40, 150])
def test_bfloat16_activations_equal_widen_then_float32_then_round(build, fmt, rows):
    """A bfloat16 x goes in and a bfloat16 result comes out of the call itself (a model served at
    bfloat16): bit for bit what widening x, the float32 call and torch's rounding give, on every
    tile tail (N 77, odd K) and row count (one, a partial micro-tile, several: the widened-tile
    path, a GEMM's), and not dependent on threads. A NaN in x rounds as torch rounds it."""
    kernels = BUILDS[build]
    n, k = 77, 320 if fmt == "mxfp4" else 301
    if fmt == "float32":
        args = {"w": torch.randn(n, k, generator=torch.Generator().manual_seed(rows))}
    else:
        args, _ = _stored(fmt, n, k, seed=rows)
    pw = qweight.pack(fmt, kernels=kernels, **args)
    g = torch.Generator().manual_seed(rows + 7)
    x = (torch.randn(3, rows, k, generator=g) * 4).bfloat16()[1]  # a view: the rows' own stride
    x[0, 3] = float("nan")
    bias = torch.randn(n, generator=g)
    want = cpu_packed.gemm(x.float(), pw, bias, threads=1).to(torch.bfloat16)
    got = cpu_packed.gemm(x, pw, bias, threads=1)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(cpu_packed.gemm(x, pw, bias, threads=2)), _bits(got))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_packed.gemm(x.half(), pw)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("rows", [1, 6, 7, 13, 40, 150])
def test_widened_tile_path_equals_the_float32_kernel_bit_for_bit(build, rows):
    """Calls of more than one micro-tile of rows widen each narrow tile once into scratch and run
    the float32 micro-tile on it: the bfloat16 weight's result is the float32 weight's (the
    widened one) bit for bit, at every row count, for linears and for both routed-expert passes."""
    kernels = BUILDS[build]
    w = torch.randn(77, 301).bfloat16()
    x = torch.randn(rows, 301)
    a, b = qweight.pack("bfloat16", w, kernels=kernels), qweight.pack("float32", w.float(), kernels=kernels)
    assert torch.equal(cpu_packed.gemm(x, a, threads=2), cpu_packed.gemm(x, b, threads=2))
    e, h, i = 4, 64, 32
    gu, dn = torch.randn(e, 2 * i, h).bfloat16(), torch.randn(e, h, i).bfloat16()
    pe = {fmt: qweight.pack_experts(e, lambda j: qweight.pack(fmt, (gu[j] if fmt == "bfloat16" else gu[j].float()),
                                                              kernels=kernels),
                                    lambda j: qweight.pack(fmt, (dn[j] if fmt == "bfloat16" else dn[j].float()),
                                                           kernels=kernels))
          for fmt in ("bfloat16", "float32")}
    g = torch.Generator().manual_seed(rows)
    xt = torch.randn(rows * 4, h, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(rows * 4)])
    wt = torch.rand(rows * 4, 2, generator=g)
    one = cpu_packed.moe_w(xt, idx, wt, pe["bfloat16"], threads=2)
    assert torch.equal(one, cpu_packed.moe_w(xt, idx, wt, pe["float32"], threads=2))
    # bfloat16 activations through the experts: widen -> float32 call -> round, bit for bit
    xb = xt.bfloat16()
    want = cpu_packed.moe_w(xb.float(), idx, wt, pe["bfloat16"], threads=1).to(torch.bfloat16)
    got = cpu_packed.moe_w(xb, idx, wt, pe["bfloat16"], threads=1)
    assert got.dtype == torch.bfloat16 and torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(cpu_packed.moe_w(xb, idx, wt, pe["bfloat16"], threads=2)), _bits(got))
