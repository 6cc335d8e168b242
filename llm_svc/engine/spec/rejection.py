"""Verification of draft tokens against the target model's logits: which drafts are kept, and
the one token that follows them.

Greedy (temperature 0): a draft is kept while it equals its row's argmax (ties: lowest id, as
``sampler.sample``); then the argmax of the first row that differs, or of the bonus row.

Sampling: drafts are deterministic proposals (n-gram lookup, greedy MTP), i.e. a point mass q
on the draft, so the Leviathan / Chen rule keeps draft d_j with probability p_j(d_j), p_j the
target distribution after temperature, min-p, top-k and top-p exactly as the sampler filters
it (``sampler.filtered_logits``); at the first rejection the token is drawn from
max(p_j - q_j, 0) renormalised, i.e. p_j without d_j; when every draft is kept, a bonus token is
drawn from p_k. Every emitted token is then distributed exactly as the target's.

Randomness, per sampled request with d drafts: 2d + 1 uniforms (float64, [0, 1)) drawn at once
from its generator (torch's default one when None): u[:d] for the acceptance tests (keep d_j
iff u[j] < p_j(d_j)), u[d + j] for the draw at row j (inverse CDF, as the sampler). With no
drafts that is the one uniform ``sample`` takes, and the token equals ``sample``'s.
Greedy requests never touch a generator. One host sync per call.
"""

from __future__ import annotations

import torch

from llm_svc.engine.sampler import filtered_logits, inverse_cdf
from shared.schemas import SamplingParams


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [d + 1, V] of one request (row j: the distribution at drafts[j]'s position, row d:
    the one after the last draft; logit_bias / penalties / grammar masks already applied) ->
    the accepted drafts followed by exactly one more token (the recovered token at the first
    rejection, or the bonus token)."""
    return verify_batch(logits, [drafts], [params], [generator])[0]


def verify_batch(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[list[int]]:
    """Several requests at once: logits [sum(d_i + 1), V], request i's d_i + 1 rows in order ->
    per request, ``verify``'s answer (identical to calling it request by request with the same
    generator states, torch's default generator consumed in request order)."""
    assert len(drafts) == len(params) == len(generators), (len(drafts), len(params), len(generators))
    counts = [len(d) + 1 for d in drafts]
    assert logits.dim() == 2 and logits.shape[0] == sum(counts), (logits.shape, counts)
    V, dev = logits.shape[1], logits.device
    starts = [sum(counts[:i]) for i in range(len(counts))]
    greedy_ids = logits.argmax(dim=-1)  # [N]
    sampled = [i for i, sp in enumerate(params) if sp.temperature > 0.0]
    host = greedy_ids
    if sampled:
        rows = [starts[i] + j for i in sampled for j in range(counts[i])]  # S rows
        row_params = [params[i] for i in sampled for _ in range(counts[i])]
        # the draft at each row, -1 on bonus rows (and for ids outside the vocabulary: rejected)
        row_draft = [d if 0 <= d < V else -1 for i in sampled for d in (*drafts[i], -1)]
        x = filtered_logits(logits.index_select(0, torch.tensor(rows, device=dev)).float(), row_params)  # [S, V]
        w = x.exp()  # [S, V] float32, as the sampler's weights
        d_t = torch.tensor(row_draft, device=dev)  # [S]
        has_draft = d_t >= 0
        d_idx = d_t.clamp(min=0).unsqueeze(1)  # [S, 1]; bonus rows point at token 0, left as it is
        w_at = w.gather(1, d_idx)  # [S, 1]
        p_draft = (w_at.squeeze(1).masked_fill(~has_draft, 0.0).double()
                   / w.sum(dim=-1, dtype=torch.float64))  # [S] p_j(d_j); 0 on bonus rows
        # max(p - q, 0) for a point mass q at the draft: the row's weights without the draft
        residual = w.scatter(1, d_idx, w_at.masked_fill(has_draft.unsqueeze(1), 0.0))  # [S, V]
        cum = torch.cumsum(residual, dim=-1, dtype=torch.float64)  # [S, V]
        u_test, u_draw = _uniforms(sampled, drafts, generators, dev)  # [S], [S, 1]
        accept = u_test < p_draft  # [S]; False on bonus rows (p 0)
        drawn = inverse_cdf(cum, u_draw).clamp(max=V - 1)  # [S]; V only on rows whose draft has all the mass
        host = torch.cat([greedy_ids, accept.long(), drawn])
    host = host.tolist()  # the one host sync: [N] greedy ids, then [S] accept flags, [S] drawn ids
    N, S = logits.shape[0], len(host) - logits.shape[0]
    greedy_host, accept_host, drawn_host = host[:N], host[N:N + S // 2], host[N + S // 2:]

    out: list[list[int]] = []
    s = 0  # offset of the current sampled request in the S rows
    for i, (d, sp) in enumerate(zip(drafts, params)):
        if sp.temperature > 0.0:
            acc, tok = accept_host[s:s + counts[i]], drawn_host[s:s + counts[i]]
            s += counts[i]
        else:
            g = greedy_host[starts[i]:starts[i] + counts[i]]
            acc, tok = [d[j] == g[j] for j in range(len(d))], g
        m = 0
        while m < len(d) and acc[m]:
            m += 1
        out.append([*d[:m], tok[m]])
    return out


def _uniforms(sampled: list[int], drafts: list[list[int]], generators: list[torch.Generator | None],
              dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampled request with d drafts, 2d + 1 uniforms from its generator -> (test [S]: the
    acceptance uniforms, 1.0 on bonus rows; draw [S, 1]: the inverse-CDF uniforms), rows in
    the S-row order of ``verify_batch``."""
    test, draw = [], []
    for i in sampled:
        d, g = len(drafts[i]), generators[i]
        u = torch.empty(2 * d + 1, device=dev, dtype=torch.float64)
        if g is None:
            u.uniform_()
        elif g.device == u.device:
            u.uniform_(generator=g)
        else:  # e.g. a cpu generator with cuda logits: drawn where the generator is, then copied
            u.copy_(torch.rand(u.shape, generator=g, device=g.device, dtype=u.dtype))
        test.append(torch.cat([u[:d], u.new_ones(1)]))
        draw.append(u[d:])
    return torch.cat(test), torch.cat(draw).unsqueeze(1)
