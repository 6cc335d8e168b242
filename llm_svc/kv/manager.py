"""One KV manager per scheduler: the two slot pools, the radix cache, and per-request views."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import NO_SLOT, LockHandle, RadixCache


@dataclass
class SeqKV:
    """A request's view of its sequence: slot per position in each pool (``-1`` = no SWA KV).

    Positions ``[0, cached_len)`` belong to the tree (pinned by ``handle``); the request owns
    every other slot in ``full`` and every valid one in ``swa``.
    """

    full: list[int]
    swa: list[int]
    cached_len: int = 0
    handle: LockHandle | None = None
    swa_released_to: int = 0  # positions below this hold no SWA in this view
    # window ends p whose SWA [p - W, p) is kept until the end (see KVManager.start)
    keep_ends: tuple[int, ...] = ()
    # False when slots of positions the runner already has were created or rewritten (a new
    # view, ``cache_prefix``): the scheduler then sends the runner a table reset
    synced: bool = False

    def __post_init__(self) -> None:
        assert len(self.full) == len(self.swa) == self.cached_len


class KVManager:
    """Allocation with eviction, window release, and caching of finished sequences."""

    def __init__(self, num_full_slots: int, num_swa_slots: int, window: int, enable_prefix_cache: bool = True):
        self.window = window
        self.enable_prefix_cache = enable_prefix_cache
        self.full_pool = SlotPool(num_full_slots, "full")
        self.swa_pool = SlotPool(num_swa_slots, "swa")
        self.tree = RadixCache(window, self.full_pool, self.swa_pool)

    # ------------------------------------------------------------------ capacity
    def available_full(self) -> int:
        """Free full slots plus what eviction could free now."""
        return self.full_pool.num_free + self.tree.evictable_full()

    def available_swa(self) -> int:
        return self.swa_pool.num_free + self.tree.evictable_swa()

    # ------------------------------------------------------------------ lifecycle
    def start(
        self,
        keys: list[int],
        forbidden_ends: list[tuple[int, int]] = (),
        checkpoints: list[int] = (),
        prompt_end: int = 0,
    ) -> SeqKV:
        """A view with the longest window-safe cached prefix of ``keys`` pinned (if caching).

        ``checkpoints``: positions ``p`` where later requests are likely to branch off (e.g. the
        end of a shared system prompt); this request keeps the SWA of ``[p - W, p)`` for the first
        one past its cached prefix, so that the tree can match up to ``p``.
        ``prompt_end``: the prompt's length, a default checkpoint: a follow-up turn re-sends the
        prompt but rarely the exact token ids generated after it (the answer re-tokenizes
        differently, reasoning is dropped), so the tree must be able to match exactly up to the
        prompt's end. (The scheduler also caches the prompt when its prefill completes, which
        keeps that window too; this covers a re-admission that recomputes past the prompt.)
        """
        if not self.enable_prefix_cache:
            return SeqKV([], [])
        if not keys:
            return SeqKV([], [], keep_ends=tuple(sorted(p for p in (*checkpoints, prompt_end) if p > 0)[:1]))
        m = self.tree.match_prefix(keys, forbidden_ends)
        # When the raw match is longer than the window-safe one, the cached sequence and this
        # one diverge at raw_length, a proven branch point whose window SWA was freed. Keeping
        # this request's SWA there revives it on insert, so the next sibling gets a full hit.
        ends = set(sorted(p for p in (*checkpoints, prompt_end) if p > m.length)[:1])  # SWA stays bounded
        if m.raw_length > m.length:
            ends.add(m.raw_length)
        keep = tuple(sorted(ends))
        if m.length == 0:
            return SeqKV([], [], keep_ends=keep)
        h = self.tree.lock(m)
        return SeqKV(
            m.full_slots, m.swa_slots, m.length, h,
            swa_released_to=max(0, m.length - self.window), keep_ends=keep,
        )

    def needs(self, seq: SeqKV, full_end: int, swa_from: int, swa_end: int) -> tuple[int, int]:
        """Slots ``reserve`` would allocate: ``(full, swa)``."""
        need_full = max(0, full_end - len(seq.full))
        lo = max(swa_from, seq.cached_len)
        have = sum(1 for p in range(lo, min(swa_end, len(seq.swa))) if seq.swa[p] != NO_SLOT)
        return need_full, max(0, swa_end - lo) - have

    def reserve(self, seq: SeqKV, full_end: int, swa_from: int, swa_end: int) -> bool:
        """Ensure full slots for positions ``< full_end`` and SWA slots for ``[swa_from, swa_end)``
        (``swa_end <= full_end``), evicting cached KV if needed. All or nothing: False (nothing
        taken) if the pools cannot hold it even after eviction."""
        assert swa_end <= full_end
        need_full, need_swa = self.needs(seq, full_end, swa_from, swa_end)
        if need_full > self.available_full() or need_swa > self.available_swa():
            return False
        short_full = need_full - self.full_pool.num_free
        short_swa = need_swa - self.swa_pool.num_free
        if short_full > 0 or short_swa > 0:
            self.tree.evict(max(0, short_full), max(0, short_swa))
        full = self.full_pool.alloc(need_full)
        swa = self.swa_pool.alloc(need_swa)
        assert full is not None and swa is not None, "eviction freed less than it promised"
        seq.full.extend(full)
        if len(seq.swa) < full_end:
            seq.swa.extend([NO_SLOT] * (full_end - len(seq.swa)))
        it = iter(swa)
        for p in range(max(swa_from, seq.cached_len), swa_end):
            if seq.swa[p] == NO_SLOT:
                seq.swa[p] = next(it)
        return True

    def release_window(self, seq: SeqKV, keep_from: int) -> None:
        """Drop SWA KV of positions ``< keep_from`` (out of every future query's window)."""
        if keep_from <= seq.swa_released_to:
            return
        freed = []
        w = self.window
        for p in range(seq.swa_released_to, min(keep_from, len(seq.swa))):
            s = seq.swa[p]
            if s != NO_SLOT:
                if p >= seq.cached_len:
                    if any(e - w <= p < e for e in seq.keep_ends):
                        continue
                    freed.append(s)
                seq.swa[p] = NO_SLOT
        self.swa_pool.free(freed)
        seq.swa_released_to = keep_from
        if keep_from >= seq.cached_len and seq.handle is not None:
            self.tree.unlock_swa(seq.handle)

    def cache_prefix(self, seq: SeqKV, keys: list[int], upto: int) -> int:
        """Hand the KV of positions ``< upto`` (computed, keys ``keys[:upto]``) to the tree while
        the request keeps running (SGLang's cache_unfinished_req): concurrent requests sharing
        the prefix hit it at once. The request then holds a lock on the new node (its window's
        SWA pinned until it is ``W`` past it) and continues from the tree's slots: where the tree
        already had the KV (another request cached it first), the request's copies are freed and
        its view switches to the tree's (same keys at the same positions, so the same KV).
        Returns the number of tokens newly cached."""
        if not self.enable_prefix_cache or upto <= seq.cached_len:
            return 0
        assert upto <= len(seq.full)
        prev = seq.cached_len
        added = self.tree.insert(keys[:upto], seq.full[:upto], seq.swa[:upto], prev)
        m = self.tree.match_exact(keys[:upto])
        h = self.tree.lock(m)
        if seq.handle is not None:
            self.tree.unlock(seq.handle)  # the new lock covers the old path
        lo = max(0, upto - self.window)
        seq.full[:upto] = m.full_slots
        seq.swa[:upto] = [NO_SLOT] * lo + m.swa_slots[lo:]
        seq.cached_len, seq.handle = upto, h
        if added != upto - prev:
            # some positions matched KV the tree already had: the view switched to those slots
            # (all new: the tree took the request's own slots, the view is unchanged)
            seq.synced = False
        seq.swa_released_to = max(seq.swa_released_to, lo)
        return added

    def finish(self, seq: SeqKV, keys: list[int], num_computed: int, cache: bool = True) -> int:
        """Give back everything ``seq`` holds. With ``cache``, the KV of positions
        ``< num_computed`` (whose keys are ``keys[:num_computed]``) goes into the tree first.
        Returns the number of tokens newly cached."""
        assert seq.cached_len <= num_computed <= len(seq.full)
        added = 0
        start = seq.cached_len
        if cache and self.enable_prefix_cache and num_computed > seq.cached_len:
            added = self.tree.insert(
                keys[:num_computed], seq.full[:num_computed], seq.swa[:num_computed], seq.cached_len
            )
            start = num_computed
        self.full_pool.free(seq.full[start:])
        self.swa_pool.free([s for s in seq.swa[start:] if s != NO_SLOT])
        if seq.handle is not None:
            self.tree.unlock(seq.handle)
        seq.full, seq.swa, seq.cached_len, seq.handle = [], [], 0, None
        seq.swa_released_to = 0
        seq.keep_ends = ()
        return added

    # ------------------------------------------------------------------ checks & stats
    def check_integrity(self, seqs: list[SeqKV]) -> None:
        """free + cached + in use == total in both pools, and no slot owned twice."""
        self.full_pool.check_integrity()
        self.swa_pool.check_integrity()
        self.tree.check_integrity()
        tree_full, tree_swa = self.tree.owned_slots()
        tf, ts = set(tree_full), set(tree_swa)
        own_full: list[int] = []
        own_swa: list[int] = []
        for q in seqs:
            assert len(q.full) == len(q.swa), "view lengths differ"
            for p in range(q.cached_len):
                assert q.full[p] in tf, "cached prefix slot not in the tree"
                assert q.swa[p] == NO_SLOT or q.swa[p] in ts, "cached SWA slot not in the tree"
            own_full.extend(q.full[q.cached_len:])
            own_swa.extend(s for s in q.swa[q.cached_len:] if s != NO_SLOT)
        for name, pool, tree, own in (
            ("full", self.full_pool, tree_full, own_full),
            ("swa", self.swa_pool, tree_swa, own_swa),
        ):
            allslots = pool.free_slots() + tree + own
            dup = [s for s, c in Counter(allslots).items() if c > 1]
            assert not dup, f"{name}: slots owned twice: {dup[:8]}"
            assert len(allslots) == pool.num_slots, (
                f"{name}: free {pool.num_free} + cached {len(tree)} + in use {len(own)} "
                f"!= total {pool.num_slots} (leak)"
            )

    def usage(self) -> dict[str, int]:
        return {
            "full_total": self.full_pool.num_slots,
            "full_free": self.full_pool.num_free,
            "full_cached": self.tree.full_tokens,
            "swa_total": self.swa_pool.num_slots,
            "swa_free": self.swa_pool.num_free,
            "swa_cached": self.tree.swa_tokens,
            "tree_nodes": self.tree.num_nodes,
        }
