"""Drafts from the checkpoint's MTP layers, chained one layer per draft token as the model was
trained (``llm_svc.models.mimo_mtp``): layer k at position p reads layer k-1's output at p (the
LM's final-normed hidden state for k = 0) and the embedding of token p+k+1; ``lm_head`` of its
output predicts token p+k+2. No policy here: the engine says which rows of a step stay and
which requests want drafts.

KV: each MTP layer is a sliding layer with its own pool, on the SWA pool's slot numbering (the
slot of position p in the main SWA pool holds p's MTP KV too), so the scheduler's allocation,
window release and rollback cover it with no bookkeeping of its own.

After each step, for every sequence of the batch that keeps ``rows`` rows (a prefill chunk: all
of them; a decode that verified drafts: its input and the accepted drafts), every layer runs over
positions ``[lo, start + rows)``. ``lo`` goes K-1 positions back before the chunk when the
previous step's rows of the same request are the ones just before it: a layer k's KV at the last
k positions was computed from drafts (token p+k+1 was not known yet) and is recomputed now from
the committed tokens, from the LM's hidden states of those positions kept since then. Where a
token a layer needs is neither committed nor drafted (the end of a prefill chunk), that layer
stops short. The last layer-k row of a drafting request gives draft k+1 (greedy).

MTP KV only ever changes drafts, never outputs: every draft is verified by the target model. So
where it is approximate it costs acceptance only: keys before the step's window start are not
read (a looked-back row sees up to K-1 fewer keys), a prefix-cache hit reuses the MTP KV of
whichever request computed it, and a request's first chunk after admission starts at its chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_svc.attention import SLIDING, AttentionParams, LayerKV
from llm_svc.attention.slot_tables import StepTables
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.models import cpu_fused
from llm_svc.models.base import apply_rope
from llm_svc.models.fused_mlp import GatedMLP
from llm_svc.models.linear import fuse_linears, pack_linears
from llm_svc.models.mimo import add_norm
from llm_svc.types.request import ForwardBatch, SeqForward


MTP_DECODE_ROWS = 8  # rows of one request up to which its MTP attention runs as a verifying decode


@dataclass
class MTPInput:
    """One sequence of the step: ``rows`` of its rows stay (0: none, e.g. it finished);
    ``tokens``: the committed token ids from position ``first`` on (at least through the one after
    its last kept row, when known); ``draft``: the request wants drafts for its next step."""

    rows: int
    first: int
    tokens: list[int]
    draft: bool
    # positions before it are never read again by a layer (a prompt's rows more than the window
    # and the layer chain before its end: ``MTPRunner.useful_from``); their rows are skipped
    useful_from: int = 0


class MTPRunner:
    """MTP layers over their own KV pools, driven after each step of ``runner``."""

    def __init__(self, runner: ModelRunner, layers: list, embed: torch.nn.Module, lm_head: torch.nn.Module,
                 window: int, linear: str = "auto"):
        assert layers, "no MTP layers"
        self.runner, self.layers, self.embed, self.lm_head = runner, list(layers), embed, lm_head
        self.window = window
        self.k = len(self.layers)
        a = self.layers[0].self_attn
        kv_heads = a.k_proj.out_features // a.head_dim
        self.kv = [LayerKV.empty(runner.num_swa_slots, kv_heads, a.head_dim, a.v_head_dim, runner.kv_dtype,
                                 runner.device) for _ in self.layers]
        self.params = [AttentionParams(scale=layer.self_attn.scaling, sinks=layer.self_attn.sinks)
                       for layer in self.layers]
        # the forward's GEMMs as the LM's: q | k | v in one, the MLP's gate | up in one, packed
        self.qkv = [fuse_linears([x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj], linear)
                    for x in self.layers]
        self.mlps = [GatedMLP.pack(x.mlp, backend=linear) for x in self.layers]
        pack_linears([m for x in self.layers for m in (x.eh_proj, x.self_attn.o_proj)], linear)
        # per request: the LM's hidden states of its last K-1 kept positions, ending at ``_end``
        self._hid: dict[str, torch.Tensor] = {}
        self._end: dict[str, int] = {}
        self._metas: dict = {}  # this step's attention metadata by layout

    def kv_bytes(self) -> int:
        return sum(t.k.numel() * t.k.element_size() + t.v.numel() * t.v.element_size() for t in self.kv)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, hidden: torch.Tensor, inputs: dict[str, MTPInput],
             max_layers: int | None = None) -> dict[str, list[int]]:
        """After a step of ``batch`` whose LM output rows are ``hidden [T, H]`` (final-normed):
        write the MTP layers' KV of the kept rows and return the drafts of the requests that want
        them (``K`` tokens each, greedy). ``max_layers``: run only the first that many layers
        (the draft policy asked for no more drafts; the later layers' KV of these rows is then
        missing, which lowers later drafts' acceptance only: every draft is verified)."""
        for rid in batch.dropped:
            self._hid.pop(rid, None)
            self._end.pop(rid, None)
        seqs: list[tuple[SeqForward, int, int, MTPInput, torch.Tensor]] = []  # (sf, lo, end, input, h0 rows)
        row = 0
        for sf in batch.seqs:
            n = len(sf.token_ids)
            x = inputs.get(sf.req_id)
            if x is not None and x.rows > 0:
                end = sf.start + x.rows
                h = hidden[row:row + x.rows]
                prev = self._hid.get(sf.req_id)
                if prev is not None and self._end.get(sf.req_id) == sf.start and len(prev):
                    h = torch.cat([prev, h])
                lo = end - h.shape[0]
                lo = max(lo, x.first, x.useful_from)
                if lo >= end:  # a prompt chunk no later draft reads: no layer runs over it
                    self._hid.pop(sf.req_id, None)
                    self._end.pop(sf.req_id, None)
                    row += n
                    continue
                h = h[h.shape[0] - (end - lo):]
                seqs.append((sf, lo, end, x, h))
                keep = min(self.k - 1, h.shape[0])
                self._hid[sf.req_id] = h[h.shape[0] - keep:].clone() if keep else h[:0]
                self._end[sf.req_id] = end
            row += n
        if not seqs:
            return {}
        self._metas = {}
        drafts: dict[str, list[int]] = {sf.req_id: [] for sf, _, _, x, _ in seqs if x.draft}
        prev = {sf.req_id: h for sf, _, _, _, h in seqs}  # each layer's input hidden rows, from lo on
        for k, layer in enumerate(self.layers[:max_layers]):
            parts = []  # (sf, lo, stop, x): layer k runs over positions [lo, stop)
            for sf, lo, end, x, _ in seqs:
                known = x.first + len(x.tokens) + len(drafts.get(sf.req_id, ()))  # tokens known: positions < known
                stop = min(end, known - k - 1, lo + prev[sf.req_id].shape[0])
                if stop > lo:
                    parts.append((sf, lo, stop, x))
            if not parts:
                break
            out = self._layer(k, layer, parts, prev, drafts)
            prev = {sf.req_id: out[sf.req_id] for sf, _, _, _ in parts}
            # the row at ``stop - 1`` predicts token ``stop + k + 1``: draft k + 1 (token ``N + k``,
            # N the committed tokens) when ``stop = N - 1``; one lm_head call for the whole batch
            want = [sf.req_id for sf, lo, stop, x in parts
                    if sf.req_id in drafts and len(drafts[sf.req_id]) == k and stop == x.first + len(x.tokens) - 1]
            if want:
                for rid, tok in zip(want, self._argmax(torch.cat([out[rid][-1:] for rid in want]))):
                    drafts[rid].append(tok)
            for sf, _, _, _, _ in seqs:
                prev.setdefault(sf.req_id, torch.empty(0, device=hidden.device))
        return {rid: d for rid, d in drafts.items() if d}

    def useful_from(self, prompt_len: int) -> int:
        """The first prompt position whose MTP rows a later step can read: each layer is a
        sliding layer, so a query at position q >= ``prompt_len`` reads keys from q - W + 1 on,
        and a later chunk looks back K - 1 rows for the chained hidden states. Rows before it
        cost a prompt's prefill K layers each for nothing (MiMo-V2.5's prompts of thousands of
        tokens against W = 128)."""
        return max(0, prompt_len - self.window - self.k)

    def _argmax(self, h: torch.Tensor) -> list[int]:
        """The greedy token of each row of ``h [n, H]``."""
        return self.lm_head(h).float().argmax(dim=-1).tolist()

    def _meta(self, parts):
        """The attention metadata of one layer's parts (the same for every layer over the same
        positions: built once per layout and step)."""
        key = tuple((sf.req_id, lo, stop) for sf, lo, stop, _ in parts)
        hit = self._metas.get(key)
        if hit is not None:
            return hit
        tables = self.runner.tables
        w = self.window
        sfs: list[SeqForward] = []
        rows: list[int] = []
        for sf, lo, stop, _ in parts:
            trow = tables.row_of[sf.req_id]
            slots = tables.swa[trow, lo:stop].tolist()
            ctx = max(sf.swa_ctx_start, lo - w + 1)
            # each query attends to its own causal window: a verifying decode's form for a few rows,
            # a prefill chunk's for more (the same keys; the chunk form runs the prefill kernel,
            # where the decode form costs about a whole LM step per row)
            n = stop - lo
            sfs.append(SeqForward(sf.req_id, [0] * n, lo, slots, slots, ctx, need_logits=True,
                                  num_drafts=n - 1 if n <= MTP_DECODE_ROWS else 0))
            rows.append(trow)
        meta = self._metas[key] = self.runner.attn.prepare(ForwardBatch(sfs), StepTables(tables.full, tables.swa, rows),
                                                           w, self.runner.device)
        return meta

    def _layer(self, k: int, layer, parts, prev: dict[str, torch.Tensor], drafts: dict[str, list[int]]):
        """Layer ``k`` over each part's positions ``[lo, stop)`` -> {req_id: output rows}."""
        dev = self.runner.device
        ids: list[int] = []
        pos: list[int] = []
        hs = []
        for sf, lo, stop, x in parts:
            toks = x.tokens + drafts.get(sf.req_id, [])
            ids.extend(toks[p + k + 1 - x.first] for p in range(lo, stop))
            pos.extend(range(lo, stop))
            hs.append(prev[sf.req_id][:stop - lo])
        h_prev = torch.cat(hs)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        e = self.embed(torch.tensor(ids, dtype=torch.long, device=dev))
        meta = self._meta(parts)
        # layer.fuse's eh_proj(cat(enorm(e), hnorm(h))), its norms (and the block's) one C pass
        # each on the CPU (torch's rms_norm took ~46 us a call on a few rows: 5 a layer)
        x = layer.eh_proj(torch.cat([add_norm(e, None, layer.enorm)[1], add_norm(h_prev, None, layer.hnorm)[1]],
                                    dim=-1))  # [T, H]
        a = layer.self_attn
        t = x.shape[0]
        y = add_norm(x, None, layer.input_layernorm)[1]
        cos, sin = self._rope(layer, y, positions)
        qkv = self.qkv[k](y)  # [T, (Hq + Hkv) * Dqk + Hkv * Dv]
        nq, nk = a.q_proj.out_features, a.k_proj.out_features
        q, kk = qkv[:, :nq].view(t, -1, a.head_dim), qkv[:, nq:nq + nk].view(t, -1, a.head_dim)
        v = qkv[:, nq + nk:].view(t, -1, a.v_head_dim)
        if cpu_fused.supports_qkv(qkv, cos, sin):  # rope and the value scale in place, one C pass (as the LM)
            cpu_fused.qkv_post(qkv, q.shape[1], kk.shape[1], a.head_dim, a.v_head_dim, cos, sin, a.v_scale)
        else:
            q, kk, v = apply_rope(q, cos, sin), apply_rope(kk, cos, sin), v * a.v_scale
        o = self.runner.attn.forward(SLIDING, q, kk, v, self.kv[k], meta, self.params[k])  # [T, Hq, Dv]
        x, y = add_norm(x, a.o_proj(o.reshape(t, -1)), layer.pre_mlp_layernorm)  # x += attention, in place
        x = add_norm(x, self.mlps[k](y), layer.final_layernorm)[1]
        out, i = {}, 0
        for sf, lo, stop, _ in parts:
            out[sf.req_id] = x[i:i + stop - lo]
            i += stop - lo
        return out

    @staticmethod
    def _rope(layer, y: torch.Tensor, positions: torch.Tensor):
        cos, sin = layer.rotary(y, positions[None], "sliding_attention")
        return cos[0], sin[0]

