"""``cpu_flash``: the batched backend's buckets attended with the CPU flash-attention kernel.

Same metadata as ``torch_batched`` (buckets, slot-table gathers, 0 / -inf biases), but each
bucket goes through ``torch_common.attend_flash`` (torch's blocked CPU flash kernel with an
online softmax; MiMo's sinks from its log-sum-exp) instead of ``bmm`` + softmax + ``bmm`` over a
materialised score tensor. Measured on this 2-core box (fp32, 8 q / 4 kv heads of 96, one
thread, sinks on): a 512-query chunk over 1,300 keys 111 -> 49 ms; 128 x 640 33 -> 24 ms;
16 decodes over 1,300 keys 16.8 -> 15.2 ms. With no score tensor to cap, full layers attend a
chunk whole (``full_q_block=0``); sliding layers keep query blocks, which cut the keys each
block reads to ``W - 1 + q_block``. Soft-capped layers, and decode buckets whose qk and v head
dims differ (the kernel wants one head size: V would be zero-padded, a copy of the context), use
the matmul path.

Decode buckets (one query per sequence) skip the gather altogether: ``cpu_paged`` reads each
context K/V row once, in place, through the bucket's slot-table rows (online softmax, sinks,
soft-cap, qk != v). Measured on the 2-core AVX2 box (tiny MiMo full layer, 16 sequences x 32K
context, 168 MB of K/V): gather + attend 40-68 ms, the kernel 16-22 ms; ``step_scaling --quick``
went from 23.7 / 41.7 / 104.6 ms to 10.2 / 16.5 / 31.2 ms per step at 256 / 8K / 32K. Where it
cannot run (no C compiler, a non-float32 pool) decodes take the gather path as before.

Sliding-layer prefill chunks go the same way (``BucketPolicy.sliding_per_query``): each query is
a decode of its own over exactly its window, read in place, so a chunk's sliding attention costs
``n * W`` key rows with no gather, no mask and no padding (a sequence with bidirectional spans
keeps query blocks). vs_vllm MiMo sliding layer (8 q / 4 kv heads of 96, W = 128, sinks, 2
threads, AVX-512 EPYC): 320 queries 3.9 -> 2.1 ms, 1,024 queries 13.6 -> 6.5 ms against
128-query blocks (gather + masked flash); 2,048 queries, 8 / 4 heads of 64: W = 256 21.0 -> 11.1
ms, W = 512 28.7 -> 23.4 ms, but W = 1,024 44.8 -> 53.1 ms: the single-query kernel has no GEMM
blocking, so windows past 512 (Gemma 3's 1,024) keep query blocks, and full layers whole chunks
(3,000 queries over their causal context: 181 vs 104 ms).

Prefill buckets go to ``cpu_prefill`` instead (``bind_pools``), sliding and
full alike: query tiles of the ``G`` heads of a kv head over exactly the keys each can see, read
in place (no gather, no mask tensor, no per-query items); the sliding per-query path and query
blocks through the flash kernel are what it replaced. 2-core AVX2 EPYC, 2 threads, fp32, a
step's ``forward`` for one chunk, min of 14 alternated: MiMo full layer (8 / 2 heads of 96) 320
queries 4.1 -> 2.4 ms, 1,024 24.7 -> 20.8, 2,048 65.2 -> 53.6, 2,048 after 4,000 keys of context
249.9 -> 248.4 (torch's flash kernel runs at ~95% of the matmul peak on this machine: as fast on
long contexts, where the kernel still saves the gather); MiMo sliding layer (8 / 4 heads, W =
128, sinks) 4.6 -> 4.2, 9.4 -> 9.1, 13.9 -> 13.4, 13.1 -> 10.9; heads of 64 over 2,048 queries,
the kernel against query blocks: W = 256 / 512 / 1,024 17.1 -> 10.5, 34.1 -> 17.5, 62.4 -> 28.5
ms. bf16 / fp16 pools too (one build of the kernel per dtype, elements widened as read).
Buckets with bidirectional spans (not ``tail``) and soft-capped layers keep the paths above.
"""

from __future__ import annotations

import torch

from . import ATTENTION_BACKENDS, cpu_paged, cpu_prefill
from .base import AttentionParams, LayerKV
from .torch_batched import Bucket, BucketPolicy, TorchBatchedAttention
from .torch_common import attend_flash, attend_tail, flash_mask


GATHER_SLICE = 256  # single queries gathered at once where the paged kernel cannot read the pool


@ATTENTION_BACKENDS.register("cpu_flash")
class CPUFlashAttention(TorchBatchedAttention):
    name = "cpu_flash"

    def __init__(self, policy: BucketPolicy | None = None):
        # sliding prefill queries go to the single-query kernel where it exists (see the docstring)
        super().__init__(policy or BucketPolicy(full_q_block=0, sliding_per_query=cpu_paged.load() is not None))
        self._own_policy = policy is None
        self.prefill_kernel = False  # set by ``bind_pools`` for a pool the prefill kernel reads
        self._masks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def bind_pools(self, kv_dtype: torch.dtype) -> None:
        """A pool ``cpu_prefill`` reads (float32, bf16, fp16) on a machine that builds it: prefill
        buckets go to it, and a chunk without bidirectional spans is one member, whole, in either kind of layer (the
        kernel tiles it; a 320-token sliding chunk as three 128-query buckets cost 2.7 ms against
        1.5 for the one call); chunks with spans keep the query blocks of the gather path."""
        self.prefill_kernel = cpu_prefill.available(kv_dtype)
        if self.prefill_kernel and self._own_policy:
            self.policy = BucketPolicy(full_q_block=0, sliding_per_query=False, plain_q_block=0)

    def prepare(self, batch, tables, window, device):
        self._masks = {}  # a step's buckets own their biases: the masks made from them live as long
        return super().prepare(batch, tables, window, device)

    def write_kv(self, cache: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if cpu_paged.supports_write(cache, k, v):
            cpu_paged.write(cache, slots, k, v)  # one C pass, no OpenMP region
        else:
            cache.write(slots, k, v)

    def attend_bucket(self, bk: Bucket, q, cache: LayerKV, params: AttentionParams) -> torch.Tensor:
        if bk.nq == 1 and cpu_paged.supports(q, cache):
            b, _, hq, d = q.shape
            out = cpu_paged.paged_decode(q.view(b, hq, d), cache, bk.table, bk.trows, bk.k0, bk.lens, params)
            return out.unsqueeze(1)
        if bk.nq == 1 and q.shape[0] > GATHER_SLICE:
            # a pool the kernel cannot read (not float32) under a bucket of many single queries
            # (sliding prefill): gathered a slice at a time, so the copy stays O(slice * window)
            return torch.cat([super(CPUFlashAttention, self).attend_bucket(bk.rows_slice(i, i + GATHER_SLICE),
                                                                           q[i:i + GATHER_SLICE], cache, params)
                              for i in range(0, q.shape[0], GATHER_SLICE)])
        if bk.nq > 1 and bk.tail and self.prefill_kernel and cpu_prefill.supports(q, cache, params):
            k0 = bk.k0 if bk.k0 is not None else torch.zeros_like(bk.lens)
            ns = torch.tensor(bk.ns, dtype=torch.long)
            return cpu_prefill.paged_prefill(q, cache, bk.table, bk.trows, k0, k0 + bk.lens - ns, ns, bk.window, params)
        if bk.nq > 1 and bk.tail and bk.window is None and params.softcap is None:
            return self._attend_tails(bk, q, cache, params)
        return super().attend_bucket(bk, q, cache, params)

    def _attend_tails(self, bk: Bucket, q, cache: LayerKV, params: AttentionParams) -> torch.Tensor:
        """Full-layer chunks, one member at a time, without a mask (``attend_tail``)."""
        kg, vg = cache.gather(bk.ctx_slots, q.dtype, self.ws)  # [Hkv, B, L, D], [Hkv, B, L, Dv]
        b, nq, hq, _ = q.shape
        out = q.new_zeros(b, nq, hq, vg.shape[-1])  # padded query rows stay 0 (dropped by the caller)
        for j, (n, L) in enumerate(zip(bk.ns, bk.lens.tolist())):
            out[j, :n] = attend_tail(q[j, :n], kg[:, j, :L], vg[:, j, :L], n, params)
        return out

    def attend(self, q, k, v, bias, params: AttentionParams):
        if params.softcap is not None or (q.shape[1] == 1 and v.shape[-1] != k.shape[-1]):
            # decodes with qk != v: zero-padding V costs a copy of the context, more than the
            # matmul path spends (tiny MiMo, 16 x 32K: 111 vs 50 ms)
            return super().attend(q, k, v, bias, params)
        g = q.shape[2] // k.shape[0]
        key = (id(bias), g)
        hit = self._masks.get(key)
        if hit is None or hit[0] is not bias:  # built once per bucket and head grouping, used by every layer
            hit = self._masks[key] = (bias, flash_mask(bias, g, k.dtype))
        return attend_flash(q, k, v, hit[1], params)
