"""FP8 block-scaled weights on CUDA: a Triton GEMM that reads the checkpoint's e4m3 weight and
its 128x128 block scales as stored (W8A16: activations stay bfloat16 / float16 / float32).

The published form (MiMo-V2-Flash / V2.5, DeepSeek-V3): ``weight`` float8_e4m3fn ``[N, K]`` and
``weight_scale_inv`` float32 ``[ceil(N/Bn), ceil(K/Bk)]``; the value of element (n, k) is
``weight[n, k] * scale[n // Bn, k // Bk]`` (``llm_svc.models.quant.dequant_fp8_block``). The
kernel walks K one scale block at a time (its K tile is ``Bk``): each tile's e4m3 values are
widened to the activations' dtype in registers (e4m3 -> bfloat16 is exact), multiplied on the
tensor cores, and the tile's partial product is scaled by its column's block scale before it is
added to the float32 accumulator. So the weight crosses HBM at 1 byte per element and is never
widened as a whole (what vLLM's and SGLang's W8A16 block kernels do on GPUs without FP8
activations; with FP8 activations Hopper's ``torch._scaled_mm`` takes over, not used here:
it needs a per-token quantization of every activation).

Routed experts: ``fp8_block_experts`` runs each expert's rows through the same kernel (the
token -> expert grouping on the host, as ``RoutedExperts.__call__`` does for dense weights).

Tested on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, read when the kernel is
first built, as ``llm_svc.attention.triton_paged`` does); timed on a GPU by
``benchmarks.gpu_check``'s ``fp8`` part.
"""

from __future__ import annotations

import os

import torch

BLOCK_M = 32
BLOCK_N = 64


def available() -> bool:
    """Whether triton imports (the kernel runs on CUDA, or anywhere under the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_KERNELS: dict[bool, object] = {}


def mode_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")  # as triton reads it


def _kernel():
    """The jitted kernel, one per ``TRITON_INTERPRET`` mode (triton reads it when it decorates)."""
    mode = mode_interpret()
    if mode not in _KERNELS:
        _KERNELS[mode] = _build()
    return _KERNELS[mode]


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_block_gemm(x_ptr, w_ptr, s_ptr, r_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       NKB: tl.constexpr, BN_SCALE: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       IEEE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)  # [BM] rows of x / y
        rn = pid_n * BN + tl.arange(0, BN)  # [BN] rows of w = columns of y
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        if HAS_ROWS:  # [BN]: each column's scale row, given (a row-chunked grid, a fused projection's part)
            s_row = tl.load(r_ptr + rn, mask=n_ok, other=0)
        else:  # one continuous grid (a tile may straddle two scale rows)
            s_row = rn // BN_SCALE
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, NKB):  # K's scale blocks (a constant per weight shape: a build per K)
            k = kb * BK + rk
            k_ok = k < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w = w.to(x.dtype)  # [BN, BK]: e4m3 widened in registers (exact into bf16 / fp16 / fp32)
            if IEEE:  # float32 activations (and the interpreter, whose 16-bit dot is wrong: triton 3.6)
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")  # [BM, BN]
            else:
                part = tl.dot(x, tl.trans(w))
            s = tl.load(s_ptr + s_row * stride_sn + kb, mask=n_ok, other=0.0)  # [BN] float32
            acc += part * s[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return fp8_block_gemm


def check_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                scale_rows: torch.Tensor | None = None) -> None:
    """Raise ValueError unless ``weight`` e4m3 ``[N, K]`` and ``scale`` agree: one continuous grid
    ``[ceil(N/Bn), ceil(K/Bk)]``, or with ``scale_rows`` (int32 ``[N]``: each weight row's scale
    row) any ``[R, ceil(K/Bk)]`` the rows index (a row-chunked grid, as MiMo's fused ``qkv_proj``
    stores it, or a part of one)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"fp8 block weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if scale_rows is not None:
        if scale_rows.shape != (n,) or scale_rows.dtype != torch.int32 or scale.dim() != 2 or scale.shape[1] != want[1]:
            raise ValueError(f"scale_rows must be int32 [{n}] over a scale of {want[1]} columns, got "
                             f"{scale_rows.dtype} {list(scale_rows.shape)} and a scale of {list(scale.shape)}")
        if n and not 0 <= int(scale_rows.min()) <= int(scale_rows.max()) < scale.shape[0]:
            raise ValueError(f"scale_rows index past the scale's {scale.shape[0]} rows")
    elif tuple(scale.shape) != want:
        raise ValueError(f"fp8 block scale has shape {list(scale.shape)}; weight {[n, k]} with blocks {[bn, bk]} "
                         f"needs {list(want)}")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"the K block must be a power of two >= 16 (a tile of the kernel), got {bk}")


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     block: tuple[int, int] = (128, 128), scale_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ (weight [N, K] e4m3 x block scales).T + bias`` -> ``[..., N]`` in x's dtype.
    ``scale`` float32 ``[ceil(N/Bn), ceil(K/Bk)]``, or any grid ``scale_rows`` indexes
    (``check_block``)."""
    check_block(weight, scale, block, scale_rows)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    s = scale.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    b = bias.contiguous() if bias is not None else s  # any pointer when there is no bias
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    rows = scale_rows.contiguous() if scale_rows is not None else s  # any pointer when there are none
    _kernel()[grid](x2, w, s, rows, b, y, m, n, k, x2.stride(0), w.stride(0), s.stride(0), y.stride(0),
                    NKB=-(-k // block[1]), BN_SCALE=block[0], HAS_ROWS=scale_rows is not None,
                    HAS_BIAS=bias is not None,
                    IEEE=x.dtype == torch.float32 or mode_interpret(),
                    BM=BLOCK_M, BN=BLOCK_N, BK=block[1])
    return y.view(*x.shape[:-1], n)


def fp8_block_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                      block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """SiLU-gated routed experts on FP8 block weights: ``x [T, H]``, ``idx [T, K]`` chosen experts,
    ``w [T, K]`` their weights; ``gate_up`` e4m3 ``[E, 2I, H]`` (gate rows first) with scales
    ``[E, ceil(2I/Bn), ceil(H/Bk)]``, ``down`` e4m3 ``[E, H, I]`` with ``[E, ceil(H/Bn), ceil(I/Bk)]``
    -> ``[T, H]`` in x's dtype."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*K]: pairs grouped by expert, token order inside
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tok = order // k
    xs = x.index_select(0, tok)  # [T*K, H]
    ys = torch.empty_like(xs)
    inter = gate_up.shape[1] // 2
    start = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        gu = fp8_block_linear(xs[start:start + c], gate_up[e], gate_up_scale[e], block=block)  # [c, 2I]
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        ys[start:start + c] = fp8_block_linear(h, down[e], down_scale[e], block=block)
        start += c
    ys.mul_(w.reshape(-1).index_select(0, order).to(ys.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, tok, ys)
