"""A vLLM-v1-hybrid-manager-like prefix cache, as bookkeeping only (the ``prefix_reuse`` baseline).

What it models (vLLM v1's ``KVCacheCoordinator`` over one ``BlockPool``; vllm #48435 describes
how this collapses for SWA-heavy models):

* one pool of equal pages shared by every KV cache group: the full-attention group and, for a
  70-layer model with 10 full layers, six sliding-window groups of 10 layers each. A block of 16
  tokens takes one page in each group it belongs to;
* blocks are cached by a hash chained over the token ids; a prefix hit of ``k`` blocks needs the
  full group's blocks ``0..k-1`` and every SWA group's last ``ceil((W-1)/16)`` blocks before ``k``;
* one free queue (LRU): pages are taken from its head, freed pages go to its tail; a finished or
  preempted request's blocks are freed in reverse order (its tail is recycled first); SWA blocks
  that slide out of the window are freed as soon as they do (still cached until recycled);
* scheduling: FCFS, decodes first, then prefill chunks within the token budget; when pages run
  out the newest running request is preempted (recompute).

The same driver as ``Scheduler`` (``add`` / ``schedule`` / ``postprocess`` / ``run`` /
``stats``) so ``prefix_reuse.run_side`` runs it on the identical trace.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from llm_svc.types.request import Request

BLOCK = 16


@dataclass
class _State:
    req: Request
    full: list[tuple] = field(default_factory=list)  # cache keys of held full blocks (None: partial)
    swa: dict[int, tuple | None] = field(default_factory=dict)  # block index -> key, while held
    computed: int = 0
    hashes: list[int] = field(default_factory=list)  # chained hash of every complete block so far
    first: bool = True


@dataclass
class _Batch:
    work: list[tuple[str, int]]  # (request id, tokens computed this step)


class HybridLRU:
    def __init__(self, total_pages: int, window: int, swa_groups: int, max_batch_tokens: int, max_running: int,
                 next_token: Callable[[Request], int]):
        self.total = total_pages
        self.window = window
        self.swa_groups = swa_groups  # pages per SWA block (one per sliding group)
        self.swa_need = -(-(window - 1) // BLOCK)  # cached blocks before a hit point
        self.budget, self.max_running = max_batch_tokens, max_running
        self.next_token = next_token
        self.uncached_free = total_pages
        self.free_queue: OrderedDict[tuple, int] = OrderedDict()  # cached, unreferenced: key -> pages
        self.refs: dict[tuple, int] = {}  # every cached key -> reference count
        self.waiting: list[_State] = []
        self.running: list[_State] = []
        self.requests: dict[str, Request] = {}
        self._st: dict[str, _State] = {}
        self.prompt_tokens = self.cached_tokens = self.preemptions = self.evictions = 0
        self.tokens_written = 0

    # ---- pages --------------------------------------------------------------------------
    def _free_pages(self) -> int:
        return self.uncached_free + sum(self.free_queue.values())

    def _take(self, pages: int) -> bool:
        if self._free_pages() < pages:
            return False
        while self.uncached_free < pages:
            key, n = self.free_queue.popitem(last=False)  # LRU head: evicted, its hash forgotten
            del self.refs[key]
            self.uncached_free += n
            self.evictions += 1
        self.uncached_free -= pages
        return True

    def _release(self, key: tuple | None, pages: int) -> None:
        if key is None or key not in self.refs:
            self.uncached_free += pages
            return
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.free_queue[key] = pages  # tail

    def _register(self, key: tuple, pages: int) -> tuple | None:
        """A freshly written full block becomes cached (unless an equal one already is: then the
        new page is a duplicate that is simply freed when released)."""
        if key in self.refs:
            return None
        self.refs[key] = 1
        return key

    def _touch(self, key: tuple) -> None:
        if self.refs[key] == 0:
            del self.free_queue[key]
        self.refs[key] += 1

    # ---- requests -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        st = _State(req)
        self.requests[req.req_id] = req
        self._st[req.req_id] = st
        self.waiting.append(st)

    def _chain(self, tokens: list[int], n_blocks: int, known: list[int]) -> list[int]:
        """Chained hashes of blocks ``0..n_blocks-1`` (``known``: a prefix of them, reused)."""
        if len(known) >= n_blocks:
            return known if len(known) == n_blocks else known[:n_blocks]
        out = list(known)
        for b in range(len(out), n_blocks):
            out.append(hash((out[-1] if out else 0, tuple(tokens[b * BLOCK:(b + 1) * BLOCK]))))
        return out

    def _hit_blocks(self, st: _State, tokens: list[int]) -> int:
        nb = (len(tokens) - 1) // BLOCK
        st.hashes = self._chain(tokens, nb, st.hashes)
        k = 0
        while k < nb and ("f", st.hashes[k]) in self.refs:
            k += 1
        while k > 0 and not all(("s", st.hashes[j]) in self.refs for j in range(max(0, k - self.swa_need), k)):
            k -= 1
        return k

    def _admit(self, st: _State) -> int:
        """Take the longest cached prefix (its blocks referenced); returns its length in blocks."""
        tokens = st.req.all_ids
        k = self._hit_blocks(st, tokens)
        for j in range(k):
            self._touch(("f", st.hashes[j]))
        for j in range(max(0, k - self.swa_need), k):
            self._touch(("s", st.hashes[j]))
        st.full = [("f", st.hashes[j]) for j in range(k)]
        st.swa = {j: ("s", st.hashes[j]) for j in range(max(0, k - self.swa_need), k)}
        st.computed = k * BLOCK
        return k

    def _free_request(self, st: _State) -> None:
        for key in reversed(st.full):
            self._release(key, 1)
        for j in sorted(st.swa, reverse=True):
            self._release(st.swa[j], self.swa_groups)
        st.full, st.swa = [], {}

    def _grow(self, st: _State, n: int) -> bool:
        """Pages for positions ``computed .. computed + n - 1``; False if the pool is out."""
        have = len(st.full)
        need = -(-(st.computed + n) // BLOCK) - have
        if need > 0 and not self._take(need * (1 + self.swa_groups)):
            return False
        for j in range(have, have + max(need, 0)):
            st.full.append(None)
            st.swa[j] = None
        return True

    def _written(self, st: _State, n: int) -> None:
        """``n`` tokens computed: complete blocks get cached, out-of-window SWA blocks freed."""
        before = st.computed // BLOCK
        st.computed += n
        self.tokens_written += n
        done = st.computed // BLOCK
        if done > len(st.hashes):
            st.hashes = self._chain(st.req.all_ids, done, st.hashes)
        for j in range(before, done):
            if st.full[j] is None:
                st.full[j] = self._register(("f", st.hashes[j]), 1)
            if j in st.swa and st.swa[j] is None:
                st.swa[j] = self._register(("s", st.hashes[j]), self.swa_groups)
        first_needed = max(0, st.computed - self.window + 1) // BLOCK  # next token's window start
        for j in [j for j in st.swa if j < first_needed]:
            self._release(st.swa.pop(j), self.swa_groups)

    def _preempt_newest(self) -> None:
        st = self.running.pop()
        self._free_request(st)
        st.computed = 0
        self.preemptions += 1
        self.waiting.insert(0, st)

    def schedule(self) -> _Batch | None:
        work: list[tuple[str, int]] = []
        budget = self.budget
        for st in list(self.running):
            if st not in self.running:
                continue
            left = st.req.num_tokens - st.computed
            n = min(left, budget) if left > 1 else 1
            while not self._grow(st, n):
                if self.running[-1] is st or len(self.running) == 1:
                    self._preempt_newest()
                    break
                self._preempt_newest()
            else:
                work.append((st.req.req_id, n))
                budget -= n
            if budget <= 0:
                break
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            st = self.waiting[0]
            k = self._admit(st)
            n = min(st.req.num_tokens - st.computed, budget)
            if n <= 0 or not self._grow(st, n):
                self._free_request(st)
                st.computed = 0
                break
            if st.first:  # hit rate at each request's first admission, as for ``Scheduler``
                st.first = False
                st.req.num_cached_tokens = k * BLOCK
                self.prompt_tokens += len(st.req.prompt_ids)
                self.cached_tokens += k * BLOCK
            self.waiting.pop(0)
            self.running.append(st)
            work.append((st.req.req_id, n))
            budget -= n
        return _Batch(work) if work else None

    def run(self, batch: _Batch) -> dict[str, int]:
        """Scripted next tokens of the requests whose step reaches their last position."""
        out = {}
        for rid, n in batch.work:
            st = self._st[rid]
            if st.computed + n == st.req.num_tokens:
                out[rid] = self.next_token(st.req)
        return out

    def postprocess(self, batch: _Batch, tokens: dict[str, int]):
        outs = []
        for rid, n in batch.work:
            st = self._st[rid]
            if st not in self.running:
                continue
            self._written(st, n)
            if rid not in tokens:
                continue
            st.req.output_ids.append(tokens[rid])
            done = len(st.req.output_ids) >= st.req.sampling.max_tokens
            if done:
                self.running.remove(st)
                self._free_request(st)
                del self._st[rid], self.requests[rid]
            outs.append(_Out(rid, done))
        return outs

    def check_integrity(self) -> None:
        assert 0 <= self._free_pages() <= self.total, (self._free_pages(), self.total)
        assert all(v >= 0 for v in self.refs.values())
        assert all(self.refs[k] == 0 for k in self.free_queue)
        if not self.running and not self.waiting:  # idle: every page is free again
            assert self._free_pages() == self.total, (self._free_pages(), self.total)

    def stats(self) -> dict:
        return {"hit_rate": self.cached_tokens / max(self.prompt_tokens, 1), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "preemptions": self.preemptions, "evictions": self.evictions}


@dataclass
class _Out:
    req_id: str
    finished: bool
