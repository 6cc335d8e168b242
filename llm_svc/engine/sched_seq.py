"""A request's next piece of work as the scheduler hands it to the runner: where its chunk ends,
how much of it a prefix-cache match may cover, which media it still lacks, and its
``SeqForward``. Pure functions of the request (and its KV view): no pools, no queues.

Prompt logprobs (``sampling.prompt_logprobs``): a chunk that holds prompt positions not yet
scored asks the runner for the logits of all its tokens (``all_logits``); row p scores prompt
token p + 1, so chunk i's last row scores chunk i + 1's first token. A cached prefix has no
logits, so such a request's prefix-cache match stops at ``prompt_scored`` (nothing on a first
admission; after a preemption, what it already scored); it still puts its prompt in the tree.
"""

from __future__ import annotations

from llm_svc.kv.radix import NO_SLOT
from llm_svc.types.request import Request, SeqForward


def missing_media(req: Request, cached_len: int) -> list[int]:
    """Items whose spans end past ``cached_len`` and that ``req`` has by reference only (a
    request without ``mm_items`` at all is bookkeeping only: nothing is missing)."""
    items = req.mm_items
    return sorted({idx for s, n, idx in req.mm_spans if s + n > cached_len and idx < len(items) and items[idx] is None})


def matchable(req: Request, total: int) -> int:
    """How many of ``req``'s ``total`` keys a prefix-cache match may cover: all but the last,
    or for a request still scoring its prompt, only the positions it has scored."""
    if req.sampling.prompt_logprobs is None or req.prompt_scored >= len(req.prompt_ids) - 1:
        return total - 1
    return min(total - 1, req.prompt_scored)


def scores(req: Request, end: int) -> bool:
    """A chunk ending at ``end`` holds prompt positions ``req`` has yet to score."""
    return req.sampling.prompt_logprobs is not None and min(end, len(req.prompt_ids) - 1) > req.prompt_scored


def chunk_end(req: Request, start: int, budget: int, chunk_tokens: int) -> int:
    """End of the next chunk from ``start``: at most ``budget`` tokens, never splitting a
    bidirectional media span (a span longer than a whole chunk, ``chunk_tokens``, goes in one
    piece)."""
    end = min(req.num_tokens, start + budget)
    if req.bidirectional:
        for s, n, _ in req.mm_spans:
            e = s + n
            if s < end < e:
                if s > start:
                    end = s
                elif e - start <= budget or e - start > chunk_tokens:
                    end = e
                else:
                    end = start
                break
    return max(end, start)


def build_seq(window: int, req: Request, start: int, end: int, drafts: list[int] = ()) -> SeqForward:
    """Positions ``[start, end)`` of ``req`` for the runner. O(end - start + W) unless the view
    needs a table reset (then O(start), once). ``drafts``: tokens after the request's last one
    to verify (``end`` counts them)."""
    kv = req.kv
    swa_start = max(0, start - window + 1)
    assert NO_SLOT not in kv.swa[swa_start:end], f"{req.req_id}: SWA KV missing inside the window"
    reset_full = reset_swa = None
    if not kv.synced:
        reset_full, reset_swa = kv.full[:start], kv.swa[swa_start:start]
        kv.synced = True
    mm_rows: list[tuple[int, int, int]] = []
    bidi: list[tuple[int, int]] = []
    for s, n, idx in req.mm_spans:
        lo, hi = max(start, s), min(end, s + n)
        mm_rows.extend((p - start, p - s, idx) for p in range(lo, hi))
        if req.bidirectional and lo < hi:
            bidi.append((s, s + n))
    return SeqForward(
        req_id=req.req_id,
        token_ids=req.token_slice(start, end - len(drafts)) + list(drafts),
        start=start,
        out_full_slots=kv.full[start:end],
        out_swa_slots=kv.swa[start:end],
        swa_ctx_start=swa_start,
        need_logits=end == req.num_tokens + len(drafts),
        all_logits=scores(req, end),
        reset_full=reset_full,
        reset_swa=reset_swa,
        mm_rows=mm_rows,
        mm_items=req.mm_items if mm_rows else [],
        bidirectional_spans=bidi,
        num_drafts=len(drafts),
    )
