"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (what vLLM and SGLang
do for decode batches; ``LLMSettings.cuda_graphs``).

A decode-only step of B sequences (one token each, last-token logits, no drafts, no media rows)
runs at the smallest bucket >= B. Its inputs are copied into the bucket's static buffers (token
ids, positions, and the per-row key ranges of ``paged_rows``), rows B.. are padding, and the
bucket's graph, captured once at start-up, replays the embedding, every layer and the LM head.
Padding rows write their K / V to one scratch slot past the end of each pool (the allocator
never hands it out) and attend to one key, so they cannot touch a request's KV. Every other
step (prefill chunks, mixed steps, drafts, media, more sequences than the largest bucket) runs
eagerly, unchanged.

What a captured graph must find where it left it:

* the KV pools (allocated once);
* the slot tables: reserved for ``max_running`` rows x ``max_positions`` at start; if they grow
  anyway, the graphs are dropped and captured again before the next replay;
* the rope tables: grown to ``max_positions`` before capture (``HybridModel.static_positions``).

It needs the ``triton_paged`` attention backend: its step metadata is plain index tensors and
its kernel reads each row's key range on the device, so one graph serves any context length.
MoE layers take ``RoutedExperts``' grouped-GEMM path while a graph is captured (no host sync).

``capture=False`` runs the same static path without a graph (each bucket's forward called on
its buffers): how the CPU tests check the padding, the scratch slots and the buffer reuse
against the eager runner. On a GPU the only extra part is ``torch.cuda.graph`` around that call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from llm_svc.attention import FULL, SLIDING
from llm_svc.attention.paged_rows import RowRanges
from llm_svc.types.request import ForwardBatch

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, then every multiple of 8 up to ``max_batch`` (vLLM's
    capture sizes), ``max_batch`` itself included."""
    assert max_batch >= 1
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass
class _Bucket:
    size: int
    longs: torch.Tensor  # [4, size] long: token id, position, full-pool out slot, SWA-pool out slot
    ints: torch.Tensor  # [4, size] int32: slot-table row, last key (hi), first SWA key, zeros (full lo)
    meta: dict[str, RowRanges] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # [size, H] the forward's output (static under a graph)
    logits: torch.Tensor | None = None  # [size, V] float32
    graph: object | None = None  # torch.cuda.CUDAGraph


class DecodeGraphs:
    """Static-buffer decode steps for ``runner`` (a ``ModelRunner`` whose pools have one scratch
    slot past ``num_full_slots`` / ``num_swa_slots``). ``max_batch``: the largest bucket;
    ``max_positions``: positions a graph may see (the longest sequence the engine admits);
    ``capture``: record CUDA graphs (False: run the static path eagerly, for CPU tests)."""

    def __init__(self, runner, max_batch: int, max_positions: int, capture: bool):
        self.runner = runner
        self.sizes = graph_buckets(max_batch)
        self.max_positions = max_positions
        self.capture = capture
        self.replays = 0  # decode steps served here (the tests and the device script read it)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # what the metas point at
        self._pool = None
        dev = runner.device
        # filled before every use: by run() with a step, by _capture_all() with padding alone
        self._buckets = {b: _Bucket(b, torch.zeros(4, b, dtype=torch.long, device=dev),
                                    torch.zeros(4, b, dtype=torch.int32, device=dev)) for b in self.sizes}

    @property
    def scratch_full(self) -> int:
        return self.runner.num_full_slots

    @property
    def scratch_swa(self) -> int:
        return self.runner.num_swa_slots

    def accepts(self, batch: ForwardBatch) -> bool:
        """A decode-only step this can serve."""
        if len(batch.seqs) > self.sizes[-1]:
            return False
        for sf in batch.seqs:
            if len(sf.token_ids) != 1 or not sf.need_logits or sf.all_logits or sf.num_drafts or sf.mm_rows:
                return False
            if sf.start >= self.max_positions or any(e > sf.start for _, e in sf.bidirectional_spans):
                return False
        return True

    def run(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """The step's ``{req_id: logits [vocab] float32}`` (as ``ModelRunner.run``)."""
        runner = self.runner
        tables = runner.tables.apply(batch)
        if self._tables is None or tables.full is not self._tables[0] or tables.swa is not self._tables[1]:
            self._bind_tables(tables.full, tables.swa)
        b = len(batch.seqs)
        bk = self._buckets[next(s for s in self.sizes if s >= b)]
        self._fill(bk, batch.seqs, tables.rows)
        if bk.graph is not None:
            bk.graph.replay()
            logits = bk.logits[:b].clone()  # the graph's output buffer is overwritten next replay
        else:
            self._forward(bk)
            logits = bk.logits[:b]
        runner.last_hidden = bk.hidden[:b]
        self.replays += 1
        return {sf.req_id: logits[i] for i, sf in enumerate(batch.seqs)}

    def capture_all(self) -> None:
        """Record every bucket's graph (largest first, sharing one memory pool), each after two
        warm-up runs on a side stream (kernels built, step metadata cached). No-op when
        ``capture`` is False. Raises whatever the capture raised (the caller turns graphs off)."""
        if not self.capture:
            return
        with torch.inference_mode():  # as ModelRunner.run: no autograd state recorded
            self._capture_all()

    def _capture_all(self) -> None:
        tables = self.runner.tables
        self._bind_tables(tables.full, tables.swa)
        torch.cuda.synchronize()
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            bk = self._buckets[size]
            self._fill(bk, [])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bk)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(bk)
            bk.graph = graph
        torch.cuda.synchronize()

    # -- internals -----------------------------------------------------------------------

    def _bind_tables(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """Point every bucket's metadata at the slot tables ``full`` / ``swa``; graphs recorded
        against older tables are dropped and, when capturing, recorded again."""
        had_graphs = any(bk.graph is not None for bk in self._buckets.values())
        self._tables = (full, swa)
        for bk in self._buckets.values():
            bk.graph = None
            n = bk.size
            row0, ones = torch.arange(n), torch.ones(n, dtype=torch.long)
            bk.meta = {
                FULL: RowRanges(bk.longs[2], bk.ints[0], bk.ints[3], bk.ints[1], full, 1, row0, ones),
                SLIDING: RowRanges(bk.longs[3], bk.ints[0], bk.ints[2], bk.ints[1], swa, 1, row0, ones),
            }
        if had_graphs:
            log.warning("slot tables grew past their reservation: recording the decode graphs again")
            self.capture_all()

    def _fill(self, bk: _Bucket, seqs, rows: list[int] = ()) -> None:
        """Copy a step's inputs into ``bk``'s buffers; rows past ``len(seqs)`` are padding."""
        window = self.runner.model.window
        pad = bk.size - len(seqs)
        pos = [sf.start for sf in seqs]
        longs = [[sf.token_ids[0] for sf in seqs] + [0] * pad, pos + [0] * pad,
                 [sf.out_full_slots[0] for sf in seqs] + [self.scratch_full] * pad,
                 [sf.out_swa_slots[0] for sf in seqs] + [self.scratch_swa] * pad]
        lo_swa = [max(sf.swa_ctx_start, p - window + 1) for sf, p in zip(seqs, pos)] + [0] * pad
        ints = [list(rows) + [0] * pad, pos + [0] * pad, lo_swa, [0] * bk.size]
        bk.longs.copy_(torch.tensor(longs, dtype=torch.long))
        bk.ints.copy_(torch.tensor(ints, dtype=torch.int32))
        if bk.meta:  # the plain-torch reference pads each row's keys to max_len (a kernel ignores it)
            bk.meta[FULL].max_len = max(pos, default=0) + 1
            bk.meta[SLIDING].max_len = max((p - lo + 1 for p, lo in zip(pos, lo_swa)), default=1)

    def _forward(self, bk: _Bucket) -> None:
        model, runner = self.runner.model, self.runner
        with model.static_positions(self.max_positions):
            h = model.embed(bk.longs[0])
            h = model.forward(h, bk.longs[1], runner.kv, runner.attn, bk.meta)
            bk.hidden, bk.logits = h, model.logits(h)
