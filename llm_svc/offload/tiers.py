"""The engine's side of the KV tiers: runs the tree's copies, writes the lower tier, fetches
from it ahead of admission, and counts it all.

Per step (``Engine``): ``run_ops`` after ``schedule`` (demotions and load-backs before the
forward reads or overwrites those slots), ``write_notes`` after ``postprocess`` and before the
next ``schedule`` (the noted device slots still hold their KV then: freed slots are reused only
by the next forward), ``touch_hits`` for prefixes served from device or host (their L3 entries
are refreshed so hot heads never age out there). A request whose prompt may extend past the
tree's match in L3 is looked up on a worker thread (``prefetch``); when the lookup is back
(or ``prefetch_timeout`` passed) the engine ``ingest``s the hit into the host tier and queues
the request, whose admission then loads it back like any host hit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from llm_svc.attention import FULL, SLIDING
from llm_svc.kv.manager import KVManager
from llm_svc.offload.host_kv import HostKV
from llm_svc.offload.l3 import PAGE, WINDOW, L3Hit, L3Store, chain_hashes


class KVTiers:
    """``host`` (L2 tensors) and optionally ``l3`` (Redis) for the scheduler's ``kv``."""

    def __init__(self, kv: KVManager, host: HostKV, l3: L3Store | None = None,
                 prefetch_timeout: float = 0.5) -> None:
        self.kv = kv
        self.host = host
        self.l3 = l3
        self.prefetch_timeout = prefetch_timeout
        self.page = kv.page_tokens
        self.window = kv.window
        self._written: OrderedDict[bytes, None] = OrderedDict()  # page hashes this replica wrote
        self._lost = 0
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="l3-lookup") if l3 is not None else None
        self.stats = {"l3_ingested_full": 0, "l3_ingested_swa": 0, "l3_ingest_dropped": 0,
                      "host_load_seconds": 0.0, "l3_wait_seconds": 0.0}

    # ------------------------------------------------------------------ every step
    def run_ops(self) -> None:
        ops = self.kv.take_ops()
        if ops:
            t0 = time.perf_counter()
            self.host.apply(ops)
            self.stats["host_load_seconds"] += time.perf_counter() - t0

    def write_notes(self) -> None:
        notes = self.kv.take_l3_notes()
        if self.l3 is None or not notes or not self.l3.up:
            return
        st = self.l3.stats
        lost = st["l3_errors"] + st["l3_dropped_writes"] + st["l3_skipped"] + st["l3_rejected_writes"]
        if lost != self._lost:  # some writes may not have landed: write pages again
            self._lost = lost
            self._written.clear()
        p = self.page
        items: list[tuple[str, bytes]] = []
        n_pages = n_windows = 0
        for note in notes:
            hashes = chain_hashes(note.keys, p)
            for j in range(1, len(hashes) + 1):
                h = hashes[j - 1]
                if h in self._written:
                    self._written.move_to_end(h)
                    continue
                payload = self.host.pack(FULL, note.full[(j - 1) * p:j * p])
                key = self.l3.page_key(hashes, j)
                items.append((key, self.l3.seal(PAGE, p, key, payload)))
                self._written[h] = None
                n_pages += 1
            for b, slots in note.windows:
                j = b // p
                if j < 1 or j > len(hashes):
                    continue
                payload = self.host.pack(SLIDING, slots)
                key = self.l3.window_key(hashes, j)
                items.append((key, self.l3.seal(WINDOW, len(slots), key, payload)))
                n_windows += 1
        while len(self._written) > 200_000:
            self._written.popitem(last=False)
        if items:
            self.l3.put(items, n_pages, n_windows)

    def touch_hits(self) -> None:
        hits = self.kv.take_hits()
        if self.l3 is None or not hits:
            return
        keys: list[str] = []
        for prefix in hits:
            hashes = chain_hashes(prefix, self.page)
            if hashes:
                keys.extend(self.l3.page_key(hashes, j) for j in range(1, len(hashes) + 1))
                keys.append(self.l3.window_key(hashes, len(hashes)))
        self.l3.touch(keys)

    # ------------------------------------------------------------------ L3 -> host
    def prefetch(self, keys: list[int]) -> Future | None:
        """Look ``keys`` (what admission will match) up in L3 if it may extend the tree's match."""
        if self.l3 is None or not self.l3.up or len(keys) < self.page:
            return None
        tree = self.kv.tree
        local = tree.peek_match_len(keys)
        if len(keys) // self.page * self.page <= local:
            return None
        return self._pool.submit(self.l3.lookup, list(keys), local, tree.peek_raw_len(keys))

    def ingest(self, keys: list[int], hit: L3Hit | None) -> int:
        """Put a hit's KV into the host tier; returns the tokens added (0 if dropped)."""
        if hit is None:
            return 0
        p = self.page
        got = self.kv.tree.insert_host(keys[:hit.length], full_from=hit.page_start * p,
                                       window_from=hit.length - hit.window_tokens)
        if got is None:
            self.stats["l3_ingest_dropped"] += 1
            return 0
        full, swa = got
        by_page: dict[int, tuple[list[int], list[int]]] = {}
        for pos, slot in full:
            rows, slots = by_page.setdefault(pos // p - hit.page_start, ([], []))
            rows.append(pos % p)
            slots.append(slot)
        for i, (rows, slots) in by_page.items():
            self.host.unpack_to_host(FULL, hit.pages[i], p, rows, slots)
        w0 = hit.length - hit.window_tokens
        self.host.unpack_to_host(SLIDING, hit.window, hit.window_tokens,
                                 [pos - w0 for pos, _ in swa], [s for _, s in swa])
        self.stats["l3_ingested_full"] += len(full)
        self.stats["l3_ingested_swa"] += len(swa)
        if self.l3 is not None:
            self.l3._count("l3_hit_tokens", len(full))
        return len(full)

    # ------------------------------------------------------------------ stats
    def metrics(self) -> dict[str, float]:
        out = {**self.stats, "host_bytes_d2h": self.host.bytes_d2h, "host_bytes_h2d": self.host.bytes_h2d,
               "host_kv_bytes": self.host.nbytes()}
        if self.l3 is not None:
            out.update(self.l3.stats)
        return out

    def close(self) -> None:
        if self.l3 is not None:
            self.l3.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
