"""Linear layers by backend: ``packed`` (CPU float32 / bfloat16, and FP8 / MXFP4 weights kept
packed from the checkpoint: our packed-weight GEMM, ``cpu_packed`` + ``qweight``),
``onednn`` (CPU: oneDNN's matmul on a weight reordered once into its blocked layout, the
primitive vLLM's CPU build and torch.compile's freezing use) or ``torch`` (``F.linear``: MKL's
sgemm on CPU, cuBLAS on CUDA).

Why not MKL on the CPU: MKL takes its AVX2 code path on AMD CPUs and reads an unpacked weight
per call; oneDNN uses the CPU's widest vectors and a packed weight. Measured on the 2-core
AVX-512 EPYC (fp32, one thread, 40 distinct [1536, 512] weights): 4 rows 17.7 -> 6.3 ms
(the weights streamed at 19 GB/s instead of 8), 512 rows 99 -> 229 GFLOP/s; two threads
at 2,048 rows 178 -> 453 GFLOP/s. Results differ from ``F.linear`` by float32 rounding only.

Why ``packed`` before oneDNN for float32: the same GEMM rate at oneDNN's bucket sizes (204-232
GFLOP/s on 2 threads, AVX-512 EPYC), every row count at its own size, decode-sized calls that
stream the weight faster than the few-row kernel, and the elastic pool instead of OpenMP's
barriers (``cpu_packed``'s docstring has the figures).

oneDNN's row buckets: oneDNN builds (JIT-compiles) a matmul primitive per input shape, about
0.5 ms each here (2 threads, [82, 512] x [512, 512]: 300 us a call with a cached primitive, 790
with a new row count every call), and a serving engine's row counts (prefill chunks of any
length, tokens per routed expert) are seldom the same twice. So a call's rows are padded up to
one of 8 sizes per octave (``row_bucket``: at most 1/8 more rows, ~6% on average), whose
primitives ``warm_buckets`` builds at start-up, and the pad rows' outputs are dropped.

``auto`` (the default) is ``packed`` for CPU float32 / bfloat16 weights when the kernel's build
for that dtype builds here, ``onednn`` for CPU float32 / bfloat16 weights when this torch has
it, ``torch`` otherwise. At bfloat16 the packed kernel reads the bfloat16 weight (2 bytes a
weight) and computes in float32: the bfloat16 input is widened and the output rounded back to
bfloat16 inside the kernel call (oneDNN's bfloat16 linears plus the unfused torch experts made our
bfloat16 slower than our float32). The packed or reordered weight of a float32 / bfloat16
module is a second copy of the matrix, so the module's own ``weight`` keeps serving
``state_dict`` and tied embeddings.

bfloat16 on a CPU with AMX tiles (``amx_bf16``): ``auto`` splits by rows (``AmxSplitLinear``):
calls of fewer than ``AMX_MIN_ROWS`` rows take the packed kernel, more take ``F.linear`` on the
module's own weight, which torch hands to oneDNN's AMX GEMM (the weight reordered per call, so no
third copy). Measured on the 2-core Xeon with AMX (best of 40 calls, [M, 512] x [512, 1536] and
[M, 4096] x [4096, 4096]): one thread, the packed kernel 135-175 GFLOP/s at every M (float32 FMAs
on widened weights), ``F.linear`` 200-240 at 16 rows, 340-410 at 32, 530-600 at 64, 750-1100 at
256; at 8 rows 105-128, slower than packed. oneDNN on a weight reordered once is up to 1.5x faster
again on one thread but, with two, collapses to 2-40 GFLOP/s whenever another process takes a
core (its threads wait at barriers), where ``F.linear`` held 300-1800.

FP8 / MXFP4 linears loaded packed (``weights.load_strict`` with ``keep_packed``) have no float
``weight`` at all: the module's ``weight`` is None and ``module.qweight`` holds the
``qweight.PackedWeight``; every function here takes such a module (``make_linear`` takes the
``PackedWeight`` itself), and ``qweight.dense`` gives the float weight back where one is needed.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.ckernels import cpu_flags
from . import cpu_gemv, cpu_packed, qweight
from .qweight import PackedWeight

log = logging.getLogger(__name__)
BACKENDS = ("auto", "packed", "onednn", "torch")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

Linear = Callable[[torch.Tensor], torch.Tensor]


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs oneDNN matmuls on packed ``dtype`` weights on this CPU (and
    gets them right): bfloat16 needs AVX-512 (BW / VL / DQ) or AVX-NE-CONVERT, float32 does not."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w, x = torch.randn(24, 16).to(dtype), torch.randn(3, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
        tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 5e-2}
        return bool(torch.allclose(got, F.linear(x, w).float(), **tol))
    except (AttributeError, RuntimeError) as e:
        log.warning("oneDNN %s linear unavailable on this CPU (%s); those linears use F.linear",
                    str(dtype).removeprefix("torch."), str(e).splitlines()[0])
        return False


@functools.cache
def amx_bf16() -> bool:
    """Whether bfloat16 GEMMs here can run on AMX tiles: the CPU has AMX-BF16 and this torch
    runs oneDNN bfloat16 matmuls (``onednn_available``)."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags() and onednn_available(torch.bfloat16)


# the fewest rows a bfloat16 call sends to oneDNN's AMX GEMM on such a CPU (the module doc's figures)
AMX_MIN_ROWS = 16

_FORMAT_OF = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def packed_format(weight: torch.Tensor) -> str | None:
    """The packed kernel's format for a CPU 2-D float32 / bfloat16 ``weight`` whose build builds
    here, else None."""
    fmt = _FORMAT_OF.get(weight.dtype)
    ok = fmt is not None and weight.device.type == "cpu" and weight.dim() == 2
    return fmt if ok and qweight.kernel(fmt) is not None else None


def resolve(backend: str, weight: torch.Tensor | PackedWeight) -> str:
    """The backend ``backend`` means for ``weight`` (``auto`` resolved; ``packed`` where it cannot
    run, e.g. a float16 weight, falls back to ``onednn``, and ``onednn`` where it cannot, e.g. a
    CUDA weight, to ``torch``). A ``PackedWeight`` is always ``packed``."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(weight, PackedWeight):
        return "packed"
    if backend == "torch":
        return "torch"
    if backend in ("auto", "packed") and packed_format(weight) is not None:
        return "packed"
    ok = weight.device.type == "cpu" and weight.dtype in _ONEDNN_DTYPES and onednn_available(weight.dtype)
    return "onednn" if ok else "torch"


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``2 ** (bit_length - 4)``: 8 sizes per octave from
    16 rows on (15 and fewer exact), so at most 1/8 of the rows are padding."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def buckets_up_to(max_rows: int, min_rows: int = cpu_gemv.MAX_ROWS + 1) -> list[int]:
    """Every ``row_bucket`` value a call of ``min_rows .. max_rows`` rows can take."""
    return sorted({row_bucket(m) for m in range(min_rows, max_rows + 1)})


# one OneDNNLinear per distinct (in, out, bias, dtype): primitives are cached by shape, not weight
_SHAPES: "weakref.WeakValueDictionary[tuple, OneDNNLinear]" = weakref.WeakValueDictionary()
_WARMED: dict[tuple, int] = {}  # (shape, threads) -> rows its buckets are built up to


class OneDNNLinear:
    """``x [..., in] -> [..., out]`` through oneDNN with ``weight [out, in]`` reordered once; rows
    padded to ``row_bucket`` so calls reuse a few cached primitives."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        w = weight.detach()
        self.dtype = w.dtype
        self.out_features, self.in_features = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = None if bias is None else bias.detach().to(w.dtype).contiguous()
        # calls of a few rows stream the plain weight through ``cpu_gemv`` (faster there); the
        # module's own tensor, not a copy
        self.weight = w if w.dtype == torch.float32 and w.is_contiguous() else None
        _SHAPES.setdefault((self.in_features, self.out_features, self.bias is not None, self.dtype), self)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """One call of exactly ``x``'s rows ``[rows, in]`` (a bucket size's: builds that primitive)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    warm = gemm  # what warm_buckets calls

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:  # F.linear would refuse too; say which side is off
            raise TypeError(f"linear of {self.dtype} weights got {x.dtype} input")
        if self.weight is not None and cpu_gemv.supports(x, self.weight):
            return cpu_gemv.linear(x, self.weight, self.bias)
        return bucketed(x, self.in_features, self.out_features, self.gemm)


class PackedLinear:
    """``x [..., in] -> [..., out]`` through ``cpu_packed`` with ``weight [out, in]`` packed once
    (float32 / bfloat16: a copy of the module's weight; or a ``PackedWeight`` of any format);
    any row count at its own size. The kernel computes in float32: a bfloat16 input is widened
    and the output rounded back inside the call (a float16 one by torch around it); the output
    has the input's dtype. A float32 weight takes float32 inputs only and a bfloat16 one
    bfloat16 inputs (as ``F.linear``); FP8 / MXFP4 weights take any float input."""

    def __init__(self, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None):
        self.weight = weight if isinstance(weight, PackedWeight) else qweight.pack(packed_format(weight), weight)
        self.out_features, self.in_features = self.weight.n, self.weight.k
        self.packed = self.weight.data
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self.weight.fmt
        if fmt in ("float32", "bfloat16") and x.dtype != _DTYPE_OF[fmt]:  # F.linear would refuse too
            raise TypeError(f"linear of {_DTYPE_OF[fmt]} weights got {x.dtype} input")
        if x.dtype in cpu_packed.ACT_DTYPES:  # bfloat16 widened and rounded inside the call
            return cpu_packed.gemm(x, self.weight, self.bias)
        return cpu_packed.gemm(x.float(), self.weight, self.bias).to(x.dtype)


_DTYPE_OF = {v: k for k, v in _FORMAT_OF.items()}


# one AmxShape per distinct GEMM on the AMX path (warm_buckets builds their primitives)
_AMX_SHAPES: "weakref.WeakValueDictionary[tuple, AmxShape]" = weakref.WeakValueDictionary()


class AmxShape:
    """A GEMM shape on the AMX path and the call that runs it (``x [rows, in] -> [rows, out]``);
    ``amx_shape`` registers one, held by its user (the registry holds it weakly)."""

    def __init__(self, call: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype):
        self.warm, self.in_features, self.dtype = call, in_features, dtype


def amx_shape(key: tuple, call: Callable[[torch.Tensor], torch.Tensor], in_features: int,
              dtype: torch.dtype) -> AmxShape:
    """Register ``call`` as the GEMM of shape ``key`` for ``warm_buckets`` (the first one of a
    key stays); keep the returned object alive as long as the call is in use."""
    shape = AmxShape(call, in_features, dtype)
    _AMX_SHAPES.setdefault(key, shape)
    return shape


class AmxSplitLinear:
    """A CPU bfloat16 ``x [..., in] -> [..., out]`` on a CPU with AMX (``amx_bf16``): calls of
    fewer than ``AMX_MIN_ROWS`` rows through the packed kernel (``PackedLinear``), more through
    ``F.linear`` on ``weight`` itself (oneDNN's AMX GEMM; no copy kept beyond the packed one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.small = PackedLinear(weight, bias)
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().to(weight.dtype)
        self.out_features, self.in_features = self.weight.shape
        # ``F.linear`` on exactly its input's rows (oneDNN's AMX GEMM); not a method: the shape
        # registry's entry must not keep this object alive
        self.gemm = functools.partial(F.linear, weight=self.weight, bias=self.bias)
        self._shape = amx_shape(("linear", self.in_features, self.out_features, bias is not None, weight.dtype),
                                self.gemm, self.in_features, weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < AMX_MIN_ROWS * self.in_features:
            return self.small(x)
        if x.dtype != self.weight.dtype:  # F.linear would refuse too; say which side is off
            raise TypeError(f"linear of {self.weight.dtype} weights got {x.dtype} input")
        return bucketed(x, self.in_features, self.out_features, self.gemm)


def bucketed(x: torch.Tensor, in_features: int, out_features: int,
             call: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``call`` (a GEMM ``[rows, in] -> [rows, out]``) on ``x [..., in]`` with the rows padded to
    ``row_bucket``, the pad rows' outputs dropped: oneDNN builds a primitive per row count (~0.5
    ms each, a few ms with AMX) and caches it by shape, and a prefill chunk's rows are seldom the
    same twice."""
    rows = x.numel() // in_features
    padded = row_bucket(rows)
    if padded == rows:
        return call(x)
    xp = x.new_empty(padded, in_features)
    xp[:rows].copy_(x.reshape(rows, in_features))
    xp[rows:].zero_()
    return call(xp)[:rows].view(*x.shape[:-1], out_features)  # [..., out], contiguous


def amx_splits(backend: str, weight: torch.Tensor | PackedWeight) -> bool:
    """Whether ``backend`` ``auto`` on ``weight`` means ``AmxSplitLinear``: a CPU bfloat16 tensor
    the packed kernel takes, on a CPU with AMX."""
    return (backend == "auto" and isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16
            and resolve(backend, weight) == "packed" and amx_bf16())


_MAKERS = {"packed": PackedLinear, "onednn": OneDNNLinear}


def make_linear(weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None, backend: str = "auto") -> Linear:
    """A callable computing ``F.linear(x, weight, bias)`` on ``backend`` (a ``PackedWeight``:
    always the packed kernel; ``auto`` on a bfloat16 weight on a CPU with AMX: ``AmxSplitLinear``)."""
    if amx_splits(backend, weight):
        return AmxSplitLinear(weight, bias)
    maker = _MAKERS.get(resolve(backend, weight))
    return maker(weight, bias) if maker else functools.partial(F.linear, weight=weight, bias=bias)


def linears_in(*modules: nn.Module) -> list[nn.Linear]:
    """Every ``nn.Linear`` under ``modules``."""
    return [m for mod in modules for m in mod.modules() if type(m) is nn.Linear]


def pack_linears(linears: Iterable[nn.Module], backend: str = "auto") -> int:
    """Route each of ``linears`` (``nn.Linear`` modules the forward calls) through ``backend``: its
    ``forward`` is replaced on the instance, its parameters stay. Only the modules a forward
    really calls should be packed: each packed weight is a second copy. Returns how many were
    packed (for our kernel or oneDNN)."""
    n = 0
    for m in linears:
        if not isinstance(m, nn.Linear):
            raise TypeError(f"pack_linears packs nn.Linear modules, got {type(m).__name__}")
        w = weight_of(m)
        if resolve(backend, w) in _MAKERS:  # (the AMX split resolves to packed)
            m.forward = make_linear(w, m.bias, backend)
            n += 1
    return n


def weight_of(m: nn.Linear) -> torch.Tensor | PackedWeight:
    """A linear's weight: its ``qweight`` (kept packed at load) or its ``weight``."""
    q = getattr(m, "qweight", None)
    return q if q is not None else m.weight


def stack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linears`` (same input size) stacked: weight ``[sum of out_features, in]`` and bias (or
    None). Keeps one copy: each module's ``weight`` / ``bias`` is rebound as a view of the stacked
    tensor, so the modules and ``state_dict`` are unchanged."""
    if not linears or any(not isinstance(m, nn.Linear) for m in linears):
        raise TypeError("stack_linears stacks nn.Linear modules")
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        raise ValueError("stacked linears need one input size and all or none with a bias")
    w = torch.cat([m.weight.detach() for m in linears], 0).contiguous()
    b = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears], 0).contiguous()
    row = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(w[row:row + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[row:row + n], requires_grad=False)
        row += n
    return w, b


class DenseOfPacked:
    """The ``forward`` of a linear kept packed at load whose packed copy now lives in a joined or
    stacked weight (``join_packed``, ``fused_mlp.RoutedExperts``): called directly, as a module
    tree's own forward does (the engine calls the fused callables instead), it widens its weight
    per call (``qweight.dense_of``): correct, not fast."""

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        return F.linear(x, qweight.dense_of(m).to(x.dtype), None if m.bias is None else m.bias.to(x.dtype))


class OwnPacked:
    """The ``forward`` a linear kept packed at load gets there: its own ``qweight`` through the
    packed kernel, its bias as it is at call time (loaded after the weight or not)."""

    def __init__(self, module: nn.Linear):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        b = None if m.bias is None else m.bias.detach().float().contiguous()
        if x.dtype in cpu_packed.ACT_DTYPES:
            return cpu_packed.gemm(x, m.qweight, b)
        return cpu_packed.gemm(x.float(), m.qweight, b).to(x.dtype)


def join_packed(linears: list[nn.Linear]) -> tuple[PackedWeight, torch.Tensor | None]:
    """``stack_linears`` of linears kept packed at load (``qweight``): their packed weights
    joined by rows (a new copy: the parts are dropped from the modules, whose ``qweight`` then
    names the joined weight and their rows in it) and their biases stacked."""
    if len({m.bias is None for m in linears}) != 1:
        raise ValueError("stacked linears need all or none with a bias")
    b = None if linears[0].bias is None else torch.cat([m.bias.detach().float() for m in linears], 0).contiguous()
    joined = {id(getattr(m, "qweight_joined", None)) for m in linears}
    if len(joined) == 1 and all(m.qweight is None for m in linears):  # joined before (a second model over one tree)
        w = linears[0].qweight_joined
        bounds = [m.qweight_rows for m in linears]
        if bounds[0][0] == 0 and bounds[-1][1] == w.n and all(a[1] == c[0] for a, c in zip(bounds, bounds[1:])):
            return w, b
    if any(m.qweight is None for m in linears):
        raise ValueError("these packed linears were joined with others before; join the same ones")
    w = qweight.concat([m.qweight for m in linears])
    row = 0
    for m in linears:
        m.qweight_rows = (row, row + m.qweight.n)
        row += m.qweight.n
        m.qweight = None  # one copy: the joined one
        m.qweight_joined = w
        m.forward = DenseOfPacked(m)
    return w, b


def fuse_linears(linears: list[nn.Linear], backend: str = "auto") -> Linear:
    """One callable computing every one of ``linears`` side by side: ``x -> [..., sum of
    out_features]`` in one GEMM over their stacked weights (``stack_linears``, or
    ``join_packed`` for linears kept packed at load). Used for q | k | v: one read of x and one
    call instead of three."""
    if all(getattr(m, "qweight", None) is not None or getattr(m, "qweight_joined", None) is not None
           for m in linears):
        return make_linear(*join_packed(linears), backend)
    return make_linear(*stack_linears(linears), backend)


def warm_buckets(max_rows: int, threads=None) -> int:
    """Build the oneDNN primitives of every row bucket up to ``max_rows`` for every linear shape
    made so far (one call each, on zeros), so no request pays for one; returns the calls made.
    Shapes: every ``OneDNNLinear``'s from ``cpu_gemv.MAX_ROWS + 1`` rows and every GEMM on the AMX
    path (``AmxSplitLinear``, bfloat16 experts: ``amx_shape``) from ``AMX_MIN_ROWS``.
    A primitive is built for a thread count: with ``threads`` (the engine's ``StepThreads``) for
    the large steps' count, for one thread (a large step runs on one while another process holds
    a core: ``StepThreads.apply``) and for the small steps' count up to their ``min_tokens - 1``
    rows (a small step's linears have at most its tokens as rows). A shape already warmed this far
    for a thread count is skipped (the primitive cache is the process's: a second engine, or a
    test process building many, pays only for shapes it adds)."""
    before = torch.get_num_threads()
    if threads is None:
        tops = {before: max_rows}
    else:
        tops = {threads.large: max_rows, 1: max_rows}
        tops[threads.small] = max(tops.get(threads.small, 0), threads.min_tokens - 1)
    n = 0
    try:
        with torch.inference_mode():
            for nthr, top in tops.items():
                for registry, first in ((_SHAPES, cpu_gemv.MAX_ROWS + 1), (_AMX_SHAPES, AMX_MIN_ROWS)):
                    for key, lin in list(registry.items()):
                        if _WARMED.get((key, nthr), 0) >= top:
                            continue
                        torch.set_num_threads(nthr)
                        sizes = buckets_up_to(top, first)
                        zeros = torch.zeros(max(sizes, default=0), lin.in_features, dtype=lin.dtype)  # sliced per bucket
                        for rows in sizes:
                            lin.warm(zeros[:rows])
                            n += 1
                        _WARMED[(key, nthr)] = top
    finally:
        torch.set_num_threads(before)
    return n
