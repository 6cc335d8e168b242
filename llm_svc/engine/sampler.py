"""Next-token sampling on the logits' device, vectorized over the batch.

Greedy, temperature, min-p, top-k, top-p and per-request seeded generators. Every row carries its own
parameters; the filters are batched tensor ops (``topk`` when every filtering row has a k, one
sort only for rows with a top-p and no top-k). The draw is an inverse-CDF sample: one uniform
per row, the first token whose running mass exceeds ``u * total``. A row with a generator takes
its uniform from that generator alone (one number per step), so a seeded request's tokens do not
depend on which other requests share its batch; rows without one share one batch-wide draw.
One host sync per call (the final ``tolist``).
"""

from __future__ import annotations

import math

import torch

from shared.schemas import SamplingParams

_SEED_RANGE = 2**64  # torch.Generator.manual_seed takes a uint64


def make_generator(params: SamplingParams, device: torch.device | str | None = None) -> torch.Generator | None:
    """A request's own RNG on ``device`` (default cpu): seeded with ``params.seed`` (reduced mod
    2**64, so any int works and ``s`` and ``s + 2**64`` agree) or from fresh entropy; None for
    greedy requests."""
    if params.temperature == 0.0:
        return None
    g = torch.Generator(device=torch.device("cpu") if device is None else torch.device(device))
    if params.seed is not None:
        g.manual_seed(params.seed % _SEED_RANGE)
    else:
        g.seed()
    return g


def _cutoffs(x: torch.Tensor, k: list[int], p: list[float]) -> torch.Tensor:
    """x [R, V] scaled logits of rows that filter -> [R, 1] the lowest value each row keeps:
    its top-k (k in 1..V; ties at the k-th value all kept), then the top-p nucleus of those
    (p in (0, 1]; the token that crosses p is kept, and so are its exact ties). Only the
    first max(k) sorted values are looked at when every row has a k < V (``topk``, not a sort)."""
    V = x.shape[1]
    kmax = max(k)
    vals = x.topk(kmax, dim=-1).values if kmax < V else x.sort(dim=-1, descending=True).values  # [R, K]
    kth = vals.gather(1, torch.tensor(k, device=x.device).unsqueeze(1) - 1)  # [R, 1]
    if all(q >= 1.0 for q in p):
        return kth
    if min(k) < vals.shape[1]:
        vals = vals.masked_fill(vals < kth, float("-inf"))
    # top-p over the renormalized top-k, from a running sum (a scan, not a reduction: a row's cut
    # does not depend on K, i.e. on the other rows' k). Token j stays iff the mass before it,
    # cum[j - 1], is <= p * total; token 0 always stays.
    cum = torch.cumsum((vals - vals[:, :1]).exp(), dim=-1, dtype=torch.float64)  # [R, K], flat past the top-k
    limit = torch.tensor([q if q < 1.0 else float("inf") for q in p], device=x.device, dtype=cum.dtype)
    limit = limit.unsqueeze(1) * cum[:, -1:]  # [R, 1]
    n_keep = 1 + torch.searchsorted(cum[:, :-1].contiguous(), limit, right=True)  # [R, 1], 1..K
    return torch.maximum(kth, vals.gather(1, n_keep - 1))


def _uniform_row(u_row: torch.Tensor, g: torch.Generator) -> None:
    """Fill u_row [1] with a U[0, 1) draw from g (drawn on g's device if it differs, then copied)."""
    if g.device == u_row.device:
        u_row.uniform_(generator=g)
    else:  # e.g. a cpu generator with cuda logits: a host-to-device copy, but never a failed step
        u_row.copy_(torch.rand(u_row.shape, generator=g, device=g.device, dtype=u_row.dtype))


def skip_draw(g: torch.Generator, device: torch.device | str) -> None:
    """Advance ``g`` past the draw of one sampled row, as ``sample`` makes it on ``device`` (the
    token was sampled elsewhere: a prefill replica's first token)."""
    _uniform_row(torch.empty(1, device=device, dtype=torch.float64), g)


def suppress(logits: torch.Tensor, banned: dict[int, list[int]]) -> torch.Tensor:
    """logits [B, V] -> a copy with ``banned[row]`` token ids at -inf in that row (EOS before
    ``min_tokens``); ``logits`` itself is left as it is (logprobs report the raw model)."""
    if not any(banned.values()):
        return logits
    rows = [r for r, ids in banned.items() for _ in ids]
    cols = [t for ids in banned.values() for t in ids]
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return out


def filtered_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x [R, V] float logits of sampled rows (temperature > 0), ``params`` one per row -> [R, V]
    log-weights: shifted so each row's max is 0, divided by the temperature, then min-p, top-k
    and top-p (in vLLM's order), dropped tokens at -inf. ``exp`` of a row is its distribution
    up to normalisation; each row depends only on its own logits and parameters."""
    assert x.dim() == 2 and x.shape[0] == len(params), (x.shape, len(params))
    V, dev = x.shape[1], x.device
    temps = torch.tensor([sp.temperature for sp in params], device=dev).unsqueeze(1)  # [R, 1]
    # shift by the row max first: tiny temperatures give -inf for the rest, never inf - inf
    x = (x - x.amax(dim=-1, keepdim=True)) / temps
    if any(sp.min_p > 0.0 for sp in params):
        # min_p (vLLM's order: after the temperature, before top-k / top-p): the row max is 0 here,
        # so p >= min_p * p_max is x >= log(min_p)
        floor = torch.tensor([math.log(sp.min_p) if sp.min_p > 0.0 else float("-inf") for sp in params],
                             device=dev).unsqueeze(1)  # [R, 1]
        x = x.masked_fill(x < floor, float("-inf"))
    ks = [sp.top_k if 0 < sp.top_k < V else V for sp in params]
    # two groups, so a top-p-only row (a full sort) does not make the top-k rows sort too
    with_k = [r for r in range(len(params)) if ks[r] < V]
    p_only = [r for r in range(len(params)) if ks[r] == V and params[r].top_p < 1.0]
    if with_k or p_only:
        cut = torch.full((len(params), 1), float("-inf"), device=dev)  # [R, 1]
        for group in (with_k, p_only):
            if group:
                idx = torch.tensor(group, device=dev)
                cut.index_copy_(0, idx, _cutoffs(x.index_select(0, idx), [ks[r] for r in group],
                                                 [params[r].top_p for r in group]))
        x = x.masked_fill(x < cut, float("-inf"))
    return x


def inverse_cdf(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """cum [R, V] float64 running mass of each row's weights, u [R, 1] uniforms in [0, 1) -> [R]
    the first token whose running mass exceeds ``u * total`` (never a token of mass 0 when the
    row's total is > 0; V when the total is 0)."""
    total = cum[:, -1:]  # [R, 1]
    # strictly below the total, so the token found always has mass > 0 (u * total can round up)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1)  # [R]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] -> one token per row. Greedy rows (temperature 0) take the argmax (ties:
    lowest id) and never touch a generator; sampled rows use their own generator, or one
    batch-wide draw from torch's default generator when theirs is None."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (logits.shape, len(params))
    greedy_ids = logits.argmax(dim=-1)  # [B]
    rows = [i for i, sp in enumerate(params) if sp.temperature > 0.0]  # the sampled rows, R of them
    if not rows:
        return greedy_ids.tolist()
    dev = logits.device
    sps = [params[i] for i in rows]
    gens = [generators[i] for i in rows]
    every_row = len(rows) == len(params)
    rows_t = None if every_row else torch.tensor(rows, device=dev)
    x = filtered_logits((logits if every_row else logits.index_select(0, rows_t)).float(), sps)  # [R, V]
    # inverse-CDF draw, one uniform per row: token = the first whose running mass exceeds u * total.
    # The running sum is float64: in float32 a token under half an ulp of the sum so far (~6e-8
    # of the total) would add nothing, and the far tail of a 150k vocabulary would never be drawn.
    cum = torch.cumsum(x.exp(), dim=-1, dtype=torch.float64)  # [R, V]; x <= 0: no overflow; masked add 0
    u = torch.empty(len(sps), 1, device=dev, dtype=cum.dtype)  # [R, 1]
    if any(g is None for g in gens):
        u.uniform_()  # one draw for every row; rows with a generator are overwritten below
    for r, g in enumerate(gens):
        if g is not None:
            _uniform_row(u[r], g)
    drawn = inverse_cdf(cum, u)  # [R]
    if every_row:
        return drawn.tolist()
    return greedy_ids.index_copy(0, rows_t, drawn).tolist()
