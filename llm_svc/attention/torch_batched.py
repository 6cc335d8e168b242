"""Batched attention in plain torch: each prefill chunk is cut into query blocks of
``q_block`` that keep only the keys they can see (sliding: ``W - 1 + q_block`` at most), and the
step's blocks are packed into few padded buckets ``q [B, nq_max]`` x ``keys [B, L_max]``; all
decodes form one bucket. One masked matmul softmax per bucket and layer.

Why blocks: on CPU a chunk's attention is compute-bound (``n x L`` scores, most of them masked
out by the window for ``n >> W``), so cutting the keys pays; padding sequences together only
saves per-call overhead, so ``BucketPolicy`` lets a member join a bucket only while the padding
it adds costs less than a call of its own (``max_pad_ratio``, ``pad_slack``), never past
``max_pairs``. Decodes never join a prefill bucket, so one long chunk cannot pad many decodes up
to its ``nq``. A bucket whose score tensor would exceed ``max_score_elems`` is attended in query
slices: peak memory is capped even for one very long chunk.

Per row the bias encodes causal + sliding window (keys in ``(p - W, p]``) + Gemma 3's
bidirectional image spans + the key padding; a padded query row gets key 0 as its only key (no
NaN from an all ``-inf`` row) and is dropped before the output is written back. MiMo's sinks
are an extra logit column in ``attend``.

Metadata per step is O(members) Python plus tensor ops: each member's key slots are read from
the runner's persistent slot tables (``table_slots``: one row slice / gather), never as Python
lists. Per layer, the context K/V is gathered once into a reused workspace, already in the
head-major ``[Hkv * B, L, D]`` layout two ``bmm`` read in place: that copy and the ``bmm``
reading it are what remains O(context) per step (reading the KV is inherent to attention; the
copy is the price of a paged pool without a paged kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llm_svc.types.request import ForwardBatch, SeqForward
from llm_svc.attention.slot_tables import StepTables

from . import ATTENTION_BACKENDS
from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV, Workspace
from .torch_common import allowed_mask, attend, ctx_range, table_slots


@dataclass(frozen=True)
class BucketPolicy:
    """How much padding a bucket may carry and how big one attention call may get."""

    # a member joins a bucket while the padded pairs it adds <= ratio * its real pairs + pad_slack
    max_pad_ratio: float = 1.0
    pad_slack: int = 8192  # about what one more attention call costs, in query x key pairs
    max_pairs: int = 1 << 22  # a bucket stops growing here (one sequence alone may exceed it)
    max_score_elems: int = 1 << 25  # B * Hq * nq * L per attention call (float32: 128 MiB)
    q_block: int = 128  # prefill chunks are attended in query blocks of this size (0: whole chunks)
    full_q_block: int | None = None  # the same for full layers (None: q_block)
    # sliding-layer prefill queries each a member of its own (nq = 1), so they join the decode
    # bucket: for a backend whose single-query kernel reads the window in place (cpu_flash), and
    # windows up to ``per_query_max_window`` (past it query blocks' GEMM-like reads win)
    sliding_per_query: bool = False
    per_query_max_window: int = 512
    # query blocks of a chunk with no bidirectional span, both kinds (None: as above): a kernel
    # that tiles a chunk itself takes it whole (0), one call instead of one bucket per block
    plain_q_block: int | None = None

    def __post_init__(self) -> None:
        assert self.max_pad_ratio >= 1.0, self.max_pad_ratio
        assert self.pad_slack >= 0 and self.q_block >= 0 and self.max_pairs >= 1 and self.max_score_elems >= 1
        assert self.full_q_block is None or self.full_q_block >= 0
        assert self.plain_q_block is None or self.plain_q_block >= 0

    def block_for(self, kind: str, spans: bool = True) -> int:
        if not spans and self.plain_q_block is not None:
            return self.plain_q_block
        return self.q_block if kind == SLIDING or self.full_q_block is None else self.full_q_block


@dataclass
class Bucket:
    """Sequences attended in one padded batch. A member ``b`` reads positions
    ``k0[b] .. k0[b] + lens[b] - 1`` of slot-table row ``trows[b]``; ``ctx_slots`` and ``bias`` are
    built from them on first use (a kernel that reads the table in place never builds them)."""

    nq: int  # padded queries per sequence
    q_index: torch.Tensor | None  # [B * nq] long: step row of each padded query (pads repeat one); None: rows 0..T-1
    real: torch.Tensor | None  # [T_b] long: the real queries among the B * nq; None: all real
    rows: torch.Tensor  # [T_b] long: their step rows
    lens: torch.Tensor  # [B] long: real keys of each member
    trows: torch.Tensor  # [B] long: each member's slot-table row
    k0: torch.Tensor | None  # [B] long: position of each member's first key (None: all 0)
    table: torch.Tensor  # [R, capacity] long: the kind's slot table
    length: int  # L: keys per member, padded
    ns: tuple[int, ...] = ()  # real queries of each member (its first ``ns[b]`` of the ``nq``)
    # every member's keys end at its last query, with no bidirectional span: the last ``ns[b]``
    # of its keys are its own queries, causal among themselves (a kernel can skip the rest)
    tail: bool = False
    window: int | None = None  # sliding buckets: keys in (p - W, p] (full: None)
    _ctx: torch.Tensor | None = None
    _bias: torch.Tensor | None = None
    _bias_fn: Callable[[], torch.Tensor] | None = None

    def rows_slice(self, i: int, j: int) -> "Bucket":
        """Members ``i .. j - 1`` of an ``nq = 1`` bucket as a bucket of their own (``q_index``
        and ``real`` dropped: the caller hands it their queries)."""
        assert self.nq == 1, "only single-query buckets are sliced"
        k0 = None if self.k0 is None else self.k0[i:j]
        return Bucket(1, None, None, self.rows[i:j], self.lens[i:j], self.trows[i:j], k0, self.table, self.length,
                      self.ns[i:j], self.tail, self.window)

    @property
    def ctx_slots(self) -> torch.Tensor:
        """[B, L] long: pool slot of each context position (pad: 0), from the slot table."""
        if self._ctx is None:
            self._ctx = table_slots(self.table, self.trows, self.k0, self.lens, self.length)
        return self._ctx

    @property
    def bias(self) -> torch.Tensor:
        """[B, nq, L] float32: 0 where the query may attend, -inf elsewhere."""
        if self._bias is None and self._bias_fn is not None:
            self._bias = self._bias_fn()
        if self._bias is None:  # decodes (nq = 1): only the key padding is masked
            ok = key_ok(self.lens, self.length)
            self._bias = torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, float("-inf"))
        return self._bias


def key_ok(lens: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, length] bool: key ``j`` of member ``b`` is real (``j < lens[b]``), not padding."""
    return (torch.arange(length, device=lens.device)[None, :] < lens[:, None])[:, None, :]


@dataclass
class KindMeta:
    out_slots: torch.Tensor  # [T] long
    buckets: list[Bucket]
    whole: bool = False  # one bucket holding rows 0..T-1 in order: its output is the layer output


@dataclass
class StepMeta:
    kinds: dict[str, KindMeta] = field(default_factory=dict)


@dataclass
class _Member:
    """A block of consecutive queries of one sequence and the context keys it can see."""

    row: int  # step row of the first query
    qstart: int  # its position
    n: int  # queries
    trow: int  # the sequence's slot-table row
    k0: int  # position of its first key
    klen: int  # keys: positions k0..k0+klen-1
    spans: list[tuple[int, int]]


def split_queries(sf: SeqForward, row: int, trow: int, kind: str, window: int, q_block: int) -> list[_Member]:
    """Cut a chunk's queries into blocks of ``q_block`` (0: one block); each block keeps only the
    keys it may see: sliding from ``qa - W + 1``, up to its last query or the end of an image
    span it overlaps. Long chunks then cost ``n * (W + q_block)`` in sliding layers, not ``n^2``.
    O(blocks) Python: the key slots come from the slot table as tensors (``_bucket``)."""
    k0, end = ctx_range(sf, kind)
    n, qs = len(sf.token_ids), sf.start
    step = q_block if q_block > 0 else n
    if sf.num_drafts and not sf.bidirectional_spans:
        step = 1  # a decode verifying drafts: each query a decode of its own (the paged decode kernel's)
    out = []
    for a in range(0, n, step):
        qa, qb = qs + a, qs + min(n, a + step)
        kend = qb
        for s, e in sf.bidirectional_spans:
            if s < qb and e > qa:
                kend = max(kend, min(e, end))
        kstart = max(k0, qa - window + 1) if kind == SLIDING else k0
        out.append(_Member(row + a, qa, qb - qa, trow, kstart, kend - kstart, sf.bidirectional_spans))
    return out


def plan_buckets(sizes: list[tuple[int, int]], policy: BucketPolicy) -> list[list[int]]:
    """Group sequences of ``(nq, L)`` into buckets (lists of indices). Single-query decodes form
    one bucket (padding keys only); query blocks go greedily in order of decreasing ``nq`` then
    ``L``, a bucket growing while within the policy's padding bounds."""
    decodes = [i for i, (n, _) in enumerate(sizes) if n == 1]
    order = sorted((i for i, (n, _) in enumerate(sizes) if n > 1), key=lambda i: (-sizes[i][0], -sizes[i][1]))
    buckets: list[list[int]] = []
    cur: list[int] = []
    nq = lmax = 0
    for i in order:
        n, length = sizes[i]
        if cur:
            lm = max(lmax, length)
            padded = (len(cur) + 1) * nq * lm
            # join if the extra padded work is cheaper than a call of its own would be
            if padded - len(cur) * nq * lmax <= policy.max_pad_ratio * n * length + policy.pad_slack \
                    and padded <= policy.max_pairs:
                cur.append(i)
                lmax = lm
                continue
            buckets.append(cur)
        cur, nq, lmax = [i], n, length
    if cur:
        buckets.append(cur)
    return buckets + ([decodes] if decodes else [])


def _bucket(members: list[_Member], kind: str, window: int, table: torch.Tensor, device) -> Bucket:
    """One bucket's index tensors, built with tensor ops on ``device`` from a few ints per member
    (no per-position Python); its bias (O(B * nq * L) tensor work) is built on first use, so a
    kernel that needs none never pays for it."""
    def t(xs):
        return torch.tensor(xs, dtype=torch.long, device=device)

    ns, lens = t([m.n for m in members]), t([m.klen for m in members])
    nq, L = max(m.n for m in members), max(m.klen for m in members)
    k0 = t([m.k0 for m in members]) if any(m.k0 for m in members) else None
    trows = t([m.trow for m in members])
    ar_q = torch.arange(nq, device=device)
    q_real = ar_q[None, :] < ns[:, None]  # [B, nq]
    starts = t([m.row for m in members])
    q_index = (starts[:, None] + torch.minimum(ar_q[None, :], (ns - 1)[:, None])).reshape(-1)  # [B * nq]
    padded = any(m.n < nq for m in members)
    real = q_real.reshape(-1).nonzero().squeeze(1) if padded else None
    rows = q_index[real] if padded else q_index
    tail = all(m.k0 + m.klen == m.qstart + m.n and not m.spans for m in members)
    w = window if kind == SLIDING else None
    bk = Bucket(nq, q_index, real, rows, lens, trows, k0, table, L, tuple(m.n for m in members), tail, w)
    if nq == 1:
        # decodes: the context is exactly what the token sees (sliding: cut to the window by the
        # scheduler; a span before it does not widen it), so only key padding is masked: the
        # bias is built lazily from ``lens``
        return bk
    bk._bias_fn = lambda: _prefill_bias(members, q_real, lens, k0, nq, L, w, device)
    return bk


def _single_queries(seqs: list[tuple[int, int, int, int, int]], window: int, table: torch.Tensor,
                    device) -> Bucket:
    """One ``nq = 1`` bucket of every query of ``seqs`` (``(step row, first position, queries,
    table row, first readable position)`` each, no bidirectional span) over its sliding window:
    query at position ``p`` reads ``max(k0, p - W + 1) .. p``. Tensor ops per sequence, no
    Python per query (a 2,048-token chunk as per-query members cost ~5 ms a step)."""
    def t(xs):
        return torch.tensor(xs, dtype=torch.long, device=device)

    rows0, pos0, ns, trows, k0s = (t(list(c)) for c in zip(*seqs))
    total = int(sum(s[2] for s in seqs))
    seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), ns, output_size=total)  # [T_b]
    offset = torch.arange(total, device=device) - (torch.cumsum(ns, 0) - ns)[seq]  # query index in its chunk
    pos = pos0[seq] + offset
    k0 = torch.maximum(k0s[seq], pos - window + 1)
    lens = pos - k0 + 1
    rows = rows0[seq] + offset
    return Bucket(1, rows, None, rows, lens, trows[seq], k0, table, int(lens.max()), (1,) * total, True, window)


def _prefill_bias(members: list[_Member], q_real, lens, k0, nq: int, L: int, w: int | None, device) -> torch.Tensor:
    """[B, nq, L] 0 / -inf: causal + window + spans + key padding; a padded query row sees key 0."""
    ar_q, ar_k = torch.arange(nq, device=device), torch.arange(L, device=device)
    qpos = torch.tensor([m.qstart for m in members], dtype=torch.long, device=device)[:, None] + ar_q  # [B, nq]
    kpos = (ar_k[None, :] if k0 is None else k0[:, None] + ar_k)  # [B or 1, L]
    kpos = kpos.expand(len(members), L)
    ok = allowed_mask(qpos, kpos, [], w)  # [B, nq, L]
    for j, m in enumerate(members):
        if m.spans:
            ok[j] = allowed_mask(qpos[j], kpos[j], m.spans, w)
    ok &= key_ok(lens, L)
    ok &= q_real[:, :, None]
    ok[:, :, 0] |= ~q_real  # a padded query row sees key 0 only: finite softmax, output dropped
    return torch.zeros(ok.shape, dtype=torch.float32, device=device).masked_fill_(~ok, float("-inf"))


def attend_capped(q, k, v, bias, params: AttentionParams, max_elems: int) -> torch.Tensor:
    """``attend`` in query slices so that no score tensor exceeds ``max_elems`` elements."""
    b, nq, hq, _ = q.shape
    step = max(1, max_elems // max(1, b * hq * k.shape[2]))
    if step >= nq:
        return attend(q, k, v, bias, params)
    return torch.cat([attend(q[:, i:i + step], k, v, bias[:, i:i + step], params) for i in range(0, nq, step)], 1)


@ATTENTION_BACKENDS.register("torch_batched", "torch")
class TorchBatchedAttention(AttentionBackend):
    name = "torch_batched"

    def __init__(self, policy: BucketPolicy | None = None):
        self.policy = policy or BucketPolicy()
        self.ws = Workspace()  # the gathered context KV, reused by every layer and step

    def attend(self, q, k, v, bias, params: AttentionParams) -> torch.Tensor:
        """q [B, nq, Hq, D], k/v [Hkv, B, L, D/Dv], bias [B, nq, L] -> [B, nq, Hq, Dv]."""
        return attend_capped(q, k, v, bias, params, self.policy.max_score_elems)

    def attend_bucket(self, bk: Bucket, q, cache: LayerKV, params: AttentionParams) -> torch.Tensor:
        """q [B, nq, Hq, D] of bucket ``bk`` over its context in ``cache`` -> [B, nq, Hq, Dv]."""
        kg, vg = cache.gather(bk.ctx_slots, q.dtype, self.ws)  # [Hkv, B, L, D], [Hkv, B, L, Dv]
        return self.attend(q, kg, vg, bk.bias, params)

    def prepare(self, batch: ForwardBatch, tables: StepTables, window: int, device: torch.device) -> StepMeta:
        meta = StepMeta()
        for kind in (FULL, SLIDING):
            out: list[int] = []
            members: list[_Member] = []
            singles: list[tuple[int, int, int, int, int]] = []  # (row, first position, n, table row, k0)
            per_query = kind == SLIDING and self.policy.sliding_per_query and window <= self.policy.per_query_max_window
            row = 0
            for sf, trow in zip(batch.seqs, tables.rows):
                out.extend(sf.out_full_slots if kind == FULL else sf.out_swa_slots)
                if per_query and not sf.bidirectional_spans:
                    singles.append((row, sf.start, len(sf.token_ids), trow, ctx_range(sf, kind)[0]))
                else:
                    block = self.policy.block_for(kind, bool(sf.bidirectional_spans))
                    members.extend(split_queries(sf, row, trow, kind, window, block))
                row += len(sf.token_ids)
            plan = plan_buckets([(m.n, m.klen) for m in members], self.policy)
            table = tables.full if kind == FULL else tables.swa
            # members keep batch order inside a bucket: a single unpadded bucket is then rows 0..T-1
            buckets = [_bucket([members[i] for i in sorted(idx)], kind, window, table, device) for idx in plan]
            if singles:
                buckets.insert(0, _single_queries(singles, window, table, device))
            whole = len(buckets) == 1 and buckets[0].real is None
            if whole:
                buckets[0].q_index = None
            meta.kinds[kind] = KindMeta(torch.tensor(out, dtype=torch.long, device=device), buckets, whole)
        return meta

    def write_kv(self, cache: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's new K / V rows at their slots (a backend may store them its own way)."""
        cache.write(slots, k, v)

    def forward(self, kind, q, k, v, cache: LayerKV, meta: StepMeta, params: AttentionParams) -> torch.Tensor:
        km = meta.kinds[kind]
        self.write_kv(cache, km.out_slots, k, v)
        t, hq, d = q.shape
        out = None if km.whole else q.new_empty(t, hq, v.shape[-1])
        for bk in km.buckets:
            b = bk.lens.shape[0]  # not ctx_slots: a kernel reading the table in place never builds them
            qg = (q if bk.q_index is None else q.index_select(0, bk.q_index)).view(b, bk.nq, hq, d)
            o = self.attend_bucket(bk, qg, cache, params)  # [B, nq, Hq, Dv]
            o = o.reshape(b * bk.nq, hq, -1)
            if km.whole:
                return o
            out.index_copy_(0, bk.rows, o if bk.real is None else o.index_select(0, bk.real))
        return out
