"""The model runner: owns the KV pool tensors and the per-request slot tables, and executes
one ``ForwardBatch``. No policy.

Input: the scheduler's batch (prefill chunks and decodes mixed, in any order; only the slots
that changed, see ``llm_svc.types.request.ForwardBatch``). Output: logits of the last token of every
sequence with ``need_logits``, of every token of a sequence with ``all_logits``, and of the
input token and each draft of a decode verifying drafts.
"""

from __future__ import annotations

import torch

from llm_svc.attention import FULL, LayerKV, create_attention_backend
from llm_svc.types.request import ForwardBatch
from llm_svc.attention.slot_tables import DeviceSlotTables
from llm_svc.models import HybridModel
from llm_svc.engine.step_threads import StepThreads
from llm_svc.engine.decode_graphs import DecodeGraphs


class ModelRunner:
    """Runs ``model`` over KV pools of ``num_full_slots`` / ``num_swa_slots`` slots.

    ``kv_dtype``: the pools' dtype (bf16/fp16/fp32), independent of the model's compute dtype
    (its weights'): K/V are cast on write and back to the compute dtype when read. ``dtype`` is
    the older name of the same argument (``kv_dtype`` wins when both are given).
    ``attention``: a registered backend name; ``auto`` picks the default for ``device``.
    ``threads``: torch threads per step by its size (None: leave torch's setting alone).
    ``decode_graphs``: the largest decode batch served from static buffers (``DecodeGraphs``;
    0: off), captured as CUDA graphs on a CUDA device; each pool then gets one scratch slot past
    its ``num_*_slots`` and the slot tables are reserved for ``table_rows`` x ``max_positions``."""

    def __init__(self, model: HybridModel, num_full_slots: int, num_swa_slots: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 attention: str = "auto", kv_dtype: torch.dtype | None = None,
                 threads: StepThreads | None = None, decode_graphs: int = 0, max_positions: int = 0,
                 table_rows: int = 16):
        self.model = model
        self.logits = True  # False: run the forward only (a tensor-parallel rank other than 0 samples nothing)
        self.threads = threads
        self.device = torch.device(device)
        self.kv_dtype = self.dtype = kv_dtype or dtype
        self.attn = create_attention_backend(attention, self.device)
        self.num_full_slots, self.num_swa_slots = num_full_slots, num_swa_slots
        self.tables = DeviceSlotTables(self.device)
        scratch = 1 if decode_graphs else 0
        self.kv: list[LayerKV] = []
        for spec in model.layers:
            n = (num_full_slots if spec.kind == FULL else num_swa_slots) + scratch
            self.kv.append(LayerKV.empty(n, spec.kv_heads, spec.qk_dim, spec.v_dim, self.kv_dtype, self.device))
        self.attn.bind_pools(self.kv_dtype)
        self.graphs: DecodeGraphs | None = None
        self.graphs_error: str | None = None  # why recording the graphs failed (build_engine sets it)
        if decode_graphs:
            assert max_positions >= 1, "decode graphs need the longest sequence the engine admits"
            self.tables.reserve(table_rows, max_positions)
            self.graphs = DecodeGraphs(self, decode_graphs, max_positions, capture=self.device.type == "cuda")

    def kv_bytes(self) -> int:
        return sum(t.k.numel() * t.k.element_size() + t.v.numel() * t.v.element_size() for t in self.kv)

    def _input_embeds(self, batch: ForwardBatch) -> torch.Tensor:
        ids = torch.tensor([t for s in batch.seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        h = self.model.embed(ids)  # [T, hidden]
        base = 0
        for sf in batch.seqs:
            if sf.mm_rows:
                by_item: dict[int, tuple[list[int], list[int]]] = {}
                for off, row, item in sf.mm_rows:
                    dst, src = by_item.setdefault(item, ([], []))
                    dst.append(base + off)
                    src.append(row)
                for item, (dst, src) in by_item.items():
                    rows = sf.mm_items[item][torch.tensor(src, dtype=torch.long)]
                    h[torch.tensor(dst, dtype=torch.long, device=self.device)] = rows.to(h.device, h.dtype)
            base += len(sf.token_ids)
        return h

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Execute the batch; returns ``{req_id: logits float32}``: ``[vocab]`` (its last token's)
        for a ``need_logits`` seq, ``[n, vocab]`` (each of its n tokens', the last included) for an
        ``all_logits`` seq, ``[d + 1, vocab]`` (its last d + 1 tokens') for a seq verifying d drafts."""
        assert batch.seqs, "empty batch"
        if self.threads is not None:
            self.threads.apply(batch.num_tokens)
        if self.graphs is not None and self.graphs.accepts(batch):
            return self.graphs.run(batch)
        tables = self.tables.apply(batch)
        positions = torch.tensor([p for s in batch.seqs for p in s.positions], dtype=torch.long,
                                 device=self.device)
        meta = self.attn.prepare(batch, tables, self.model.window, self.device)
        h = self.model.forward(self._input_embeds(batch), positions, self.kv, self.attn, meta)
        self.last_hidden = h  # [T, H] final-normed: the MTP layers' input (valid until the next run)
        if not self.logits:
            return {}
        rows: list[int] = []
        spans: list[tuple[str, int, int, bool]] = []  # (req_id, first row in ``rows``, count, all rows)
        row = 0
        for sf in batch.seqs:
            n = len(sf.token_ids)
            if sf.all_logits or sf.need_logits:
                k = n if sf.all_logits else sf.num_drafts + 1
                spans.append((sf.req_id, len(rows), k, sf.all_logits or sf.num_drafts > 0))
                rows.extend(range(row + n - k, row + n))
            row += n
        if not rows:
            return {}
        logits = self.model.logits(h[torch.tensor(rows, dtype=torch.long, device=self.device)])  # [R, vocab]
        return {rid: logits[i:i + k] if every else logits[i] for rid, i, k, every in spans}
