"""A model stand-in for driving the scheduler without tensors (tests and benchmarks).

``SimRunner`` plays the runner's part of the engine step. With ``verify=True`` it stores, per
slot, ``(position, hash of keys[0..position])`` when a step writes it and checks that every
context slot a step reads holds exactly the KV of that position of *that* sequence, so a
pseudo-hit (stale, foreign or out-of-window KV) raises at once. Its default next token is
derived from what the read slots hold, so a wrong read also changes the output: caching on vs
off must give identical tokens. ``next_token`` overrides the choice (e.g. a scripted trace).
It keeps the slot tables exactly as the model runner does (``HostSlotTables``, fed only the
batch's changes), so a missing table reset reads the wrong slots and raises too.
"""

from __future__ import annotations

from collections.abc import Callable

from llm_svc.types.request import ForwardBatch, Request, SeqForward
from llm_svc.attention.slot_tables import HostSlotTables


class KVReadError(AssertionError):
    """A step read a slot that does not hold the KV it should."""


class SimRunner:
    def __init__(
        self,
        requests: Callable[[str], Request],
        window: int,
        vocab: int = 40,
        verify: bool = True,
        next_token: Callable[[Request, SeqForward], int] | None = None,
    ) -> None:
        self.requests = requests
        self.window = window
        self.vocab = vocab
        self.verify = verify
        self.next_token = next_token
        self.full: dict[int, tuple[int, int]] = {}
        self.swa: dict[int, tuple[int, int]] = {}
        self.tables = HostSlotTables()
        self.tokens_read = 0
        self.tokens_written = 0

    @staticmethod
    def prefix_hashes(keys: list[int], end: int) -> list[int]:
        out, h = [], 0
        for k in keys[:end]:
            h = hash((h, k))
            out.append(h)
        return out

    def run(self, batch: ForwardBatch) -> dict[str, int]:
        """Next token for every seq with ``need_logits``."""
        out: dict[str, int] = {}
        self.tables.apply(batch)
        for sf in batch.seqs:
            req = self.requests(sf.req_id)
            end = sf.end
            self.tokens_written += len(sf.token_ids)
            self.tokens_read += end
            if self.verify:
                self._write_and_check(req, sf, end)
            if sf.need_logits:
                out[sf.req_id] = self.next_token(req, sf) if self.next_token else self._derived_token(sf, end)
        return out

    def _write_and_check(self, req: Request, sf: SeqForward, end: int) -> None:
        if sf.token_ids != req.all_ids[sf.start:end]:
            raise KVReadError(f"{sf.req_id}: token ids differ from the request's")
        hs = self.prefix_hashes(req.all_keys, end)
        for i, p in enumerate(sf.positions):
            self.full[sf.out_full_slots[i]] = (p, hs[p])
            self.swa[sf.out_swa_slots[i]] = (p, hs[p])
        ctx_full, ctx_swa = self.tables.ctx_full(sf), self.tables.ctx_swa(sf)
        if len(set(ctx_full)) != end or len(set(ctx_swa)) != len(ctx_swa):
            raise KVReadError(f"{sf.req_id}: a slot appears twice in the context")
        for q, slot in enumerate(ctx_full):
            if self.full.get(slot) != (q, hs[q]):
                raise KVReadError(f"{sf.req_id}: full pseudo-hit at position {q} (slot {slot})")
        for j, slot in enumerate(ctx_swa):
            q = sf.swa_ctx_start + j
            if self.swa.get(slot) != (q, hs[q]):
                raise KVReadError(f"{sf.req_id}: SWA pseudo-hit at position {q} (slot {slot})")

    def _derived_token(self, sf: SeqForward, end: int) -> int:
        # depends on what the slots hold (not on the chunking): the last token's window start,
        # the token itself and position 0
        full, swa = self.tables.full[sf.req_id], self.tables.swa[sf.req_id]
        oldest = swa[max(0, end - self.window)]
        seen = (self.full.get(full[end - 1]), self.swa.get(oldest), self.full.get(full[0]))
        return hash(seen) % self.vocab
