"""One KV manager per scheduler: the two slot pools, the radix cache, and per-request views."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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


@dataclass
class L3Write:
    """KV a lower tier should get, as device slots valid until the next ``schedule``: full KV of
    positions ``[0, len(full))`` (keys ``keys``) and SWA windows ``(b, slots of [b - W, b))``."""

    keys: list[int]
    full: list[int]
    windows: list[tuple[int, list[int]]] = field(default_factory=list)


class KVManager:
    """Allocation with eviction, window release, and caching of finished sequences.

    ``num_host_*``: host (L2) pools of the prefix tree; 0 for none. ``page_tokens`` > 0 turns on
    the notes for a shared lower tier (``l3_notes``, drained by the engine): the pages and SWA
    windows of every prompt at prefill end and of every sequence when it leaves, windows at
    multiples of ``page_tokens``."""

    def __init__(self, num_full_slots: int, num_swa_slots: int, window: int, enable_prefix_cache: bool = True,
                 num_host_full: int = 0, num_host_swa: int = 0, page_tokens: int = 0):
        self.window = window
        self.enable_prefix_cache = enable_prefix_cache
        self.full_pool = SlotPool(num_full_slots, "full")
        self.swa_pool = SlotPool(num_swa_slots, "swa")
        self.host_full_pool = SlotPool(num_host_full, "host_full") if num_host_full > 0 else None
        self.host_swa_pool = SlotPool(num_host_swa, "host_swa") if num_host_full > 0 else None
        self.tree = RadixCache(window, self.full_pool, self.swa_pool, self.host_full_pool, self.host_swa_pool)
        self.page_tokens = page_tokens
        self.l3_notes: list[L3Write] = []
        # prefixes served from the tree at admission (the engine refreshes them in the lower tier)
        self.hits: list[list[int]] = []

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
        if self.page_tokens and prompt_end > m.length:
            # the lower tier stores windows at page boundaries: keep the prompt's last one
            b = prompt_end // self.page_tokens * self.page_tokens
            if b > m.length:
                ends.add(b)
        keep = tuple(sorted(ends))
        if m.length == 0:
            return SeqKV([], [], keep_ends=keep)
        h = self.tree.lock(m)
        if m.needs_load and not self.tree.load(m):
            # the device cannot take the host part now: use what the device has
            self.tree.unlock(h)
            m = self.tree.match_prefix(keys, forbidden_ends, device_only=True)
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
        got = self._take(*self.needs(seq, full_end, swa_from, swa_end))
        if got is None:
            return False
        full, swa = got
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

    def truncate(self, seq: SeqKV, n: int) -> None:
        """Give back the slots of positions ``>= n`` (rejected draft positions): the view then
        covers ``[0, n)``. Only positions the request owns (``n >= cached_len``)."""
        assert seq.cached_len <= n <= len(seq.full)
        self.full_pool.free(seq.full[n:])
        self.swa_pool.free([s for s in seq.swa[n:] if s != NO_SLOT])
        del seq.full[n:]
        del seq.swa[n:]

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

    # ------------------------------------------------------------------ KV computed elsewhere
    def adopt(self, n: int, window_from: int) -> tuple[list[int], list[int]] | None:
        """Slots for the KV of ``n`` positions computed elsewhere (a prefill replica's hand-over):
        a full slot for each of ``[0, n)``, a SWA slot for each of ``[window_from, n)``, evicting
        cached KV if needed. None (nothing taken) without a prefix cache or when the pools cannot
        hold it. Eviction may record tier copies of the slots handed out: the caller runs them
        (``take_ops``) before writing the KV, then gives the slots to the tree (``cache_adopted``)
        before the next ``schedule``."""
        assert 0 <= window_from <= n
        if not self.enable_prefix_cache or n < 1:
            return None
        return self._take(n, n - window_from)

    def _take(self, need_full: int, need_swa: int) -> tuple[list[int], list[int]] | None:
        """``need_full`` full and ``need_swa`` SWA slots, evicting cached KV for them if needed;
        None (nothing taken) if the pools cannot hold them even after eviction."""
        if need_full > self.available_full() or need_swa > self.available_swa():
            return None
        short_full = need_full - self.full_pool.num_free
        short_swa = need_swa - self.swa_pool.num_free
        if short_full > 0 or short_swa > 0:
            self.tree.evict(max(0, short_full), max(0, short_swa))
        full = self.full_pool.alloc(need_full)
        swa = self.swa_pool.alloc(need_swa)
        assert full is not None and swa is not None, "eviction freed less than it promised"
        return full, swa

    def cache_adopted(self, keys: list[int], full: list[int], swa: list[int], window_from: int) -> int:
        """Hand ``adopt``'s slots, now holding the KV of ``keys``, to the prefix tree (positions
        before ``window_from`` have no SWA KV); a request with that prefix then hits it like any
        cached prefix. Returns the tokens newly cached (slots of keys the tree had are freed)."""
        assert len(full) == len(keys) and len(swa) == len(keys) - window_from
        return self.tree.insert(keys, full, [NO_SLOT] * window_from + swa, 0)

    def give_back(self, full: list[int], swa: list[int]) -> None:
        """``adopt``'s slots when their KV cannot be used after all."""
        self.full_pool.free(full)
        self.swa_pool.free(swa)

    # ------------------------------------------------------------------ lower-tier notes
    def note_l3(self, seq: SeqKV, keys: list[int], upto: int, boundaries: list[int] = ()) -> None:
        """Note the KV of positions ``< upto`` (computed) for the lower tier, with the SWA window
        before each page-aligned boundary in ``boundaries``, before ``upto``'s last page boundary
        and before ``upto - 1``'s (the same prompt sent again computes its last token, so its
        lookup ends there: for a prompt of whole pages that is a page earlier) that ``seq`` still
        holds. A no-op without ``page_tokens``."""
        p = self.page_tokens
        if not p or not self.enable_prefix_cache or upto < p:
            return
        w = self.window
        windows = []
        for b in sorted({*(x // p * p for x in boundaries if 0 < x <= upto), upto // p * p, (upto - 1) // p * p}):
            lo = max(0, b - w)
            slots = seq.swa[lo:b]
            if b > 0 and NO_SLOT not in slots:
                windows.append((b, list(slots)))
        self.l3_notes.append(L3Write(list(keys[:upto // p * p]), list(seq.full[:upto // p * p]), windows))

    def take_l3_notes(self) -> list[L3Write]:
        notes, self.l3_notes = self.l3_notes, []
        return notes

    def take_hits(self) -> list[list[int]]:
        hits, self.hits = self.hits, []
        return hits

    def take_ops(self) -> list[tuple[str, list[int], list[int]]]:
        """Tier copies recorded since the last call, in the order they must run (before the
        next forward)."""
        return self.tree.take_ops()

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
        if self.host_full_pool is not None:
            host_full, host_swa = self.tree.owned_host_slots()
            for name, pool, tree in (("host_full", self.host_full_pool, host_full),
                                     ("host_swa", self.host_swa_pool, host_swa)):
                pool.check_integrity()
                allslots = pool.free_slots() + tree
                assert len(set(allslots)) == len(allslots), f"{name}: a slot is owned twice"
                assert len(allslots) == pool.num_slots, (
                    f"{name}: free {pool.num_free} + cached {len(tree)} != total {pool.num_slots} (leak)")

    def usage(self) -> dict[str, int]:
        return {
            "full_total": self.full_pool.num_slots,
            "full_free": self.full_pool.num_free,
            "full_cached": self.tree.full_tokens,
            "swa_total": self.swa_pool.num_slots,
            "swa_free": self.swa_pool.num_free,
            "swa_cached": self.tree.swa_tokens,
            "tree_nodes": self.tree.num_nodes,
            "host_full_total": self.host_full_pool.num_slots if self.host_full_pool else 0,
            "host_full_cached": self.tree.host_full_tokens,
            "host_swa_total": self.host_swa_pool.num_slots if self.host_swa_pool else 0,
            "host_swa_cached": self.tree.host_swa_tokens,
            **{f"tree_{k}": v for k, v in self.tree.stats.items()},
        }
