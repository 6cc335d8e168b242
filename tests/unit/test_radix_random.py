"""Random operation sequences on the radix tree, checked against brute force after every op."""

from __future__ import annotations

import random

import pytest

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import NO_SLOT, RadixCache

pytestmark = pytest.mark.unit


def path_slots(tree: RadixCache, keys: list[int]) -> tuple[list[int], list[int]]:
    """Full and SWA slots along the longest cached path of ``keys``, read node by node."""
    full, swa, node, pos = [], [], tree.root, 0
    while pos < len(keys) and keys[pos] in node.children:
        child = node.children[keys[pos]]
        k = 0
        while k < len(child.key) and pos + k < len(keys) and child.key[k] == keys[pos + k]:
            k += 1
        full += child.device.full[:k]
        swa += child.device.swa[:k]
        pos += k
        if k < len(child.key):
            break
        node = child
    return full, swa


def brute_safe_len(swa: list[int], w: int) -> int:
    for ln in range(len(swa), 0, -1):
        if all(s != NO_SLOT for s in swa[max(0, ln - w):ln]):
            return ln
    return 0


@pytest.mark.parametrize("seed", range(4))
def test_random_ops_match_brute_force_and_keep_integrity(seed):
    rng = random.Random(seed)
    w = rng.choice([1, 3, 5])
    full_pool, swa_pool = SlotPool(400, "full"), SlotPool(400, "swa")
    tree = RadixCache(w, full_pool, swa_pool)
    locks = []

    def rand_keys():
        return [rng.randrange(3) for _ in range(rng.randint(1, 14))]

    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            keys = rand_keys()
            # a request reuses the window-safe cached prefix and computes the rest
            m = tree.match_prefix(keys)
            h = tree.lock(m)
            n_new = len(keys) - m.length
            full = full_pool.alloc(n_new)
            swa_new = swa_pool.alloc(n_new)
            if full is None or swa_new is None:
                full_pool.free(full or [])
                swa_pool.free(swa_new or [])
                tree.evict(n_new, n_new)
                tree.unlock(h)
                continue
            mask = [rng.random() < 0.6 for _ in range(n_new)]
            kept = [s if k else NO_SLOT for s, k in zip(swa_new, mask)]
            swa_pool.free([s for s, k in zip(swa_new, mask) if not k])
            tree.insert(keys, m.full_slots + full, m.swa_slots + kept, owned_from=m.length)
            tree.unlock(h)
        elif op < 0.6:
            keys = rand_keys()
            full, swa = path_slots(tree, keys)
            m = tree.match_prefix(keys)
            assert m.length == brute_safe_len(swa, w)
            assert m.full_slots == full[: m.length]
            lo = max(0, m.length - w)
            assert m.swa_slots[lo:] == swa[lo:m.length] and NO_SLOT not in m.swa_slots[lo:]
            if rng.random() < 0.5:
                locks.append((tree.lock(m), keys[: m.length], m.full_slots))
        elif op < 0.75 and locks:
            i = rng.randrange(len(locks))
            if rng.random() < 0.7:
                tree.unlock(locks.pop(i)[0])
            else:
                tree.unlock_swa(locks[i][0])  # still pins the full path
        else:
            tree.evict(rng.randint(0, 30), rng.randint(0, 30))
        tree.check_integrity()
        f, s = tree.owned_slots()
        assert sorted(f + full_pool.free_slots()) == list(range(400))
        assert sorted(s + swa_pool.free_slots()) == list(range(400))
        for h, keys, full_slots in locks:  # pinned prefixes stay whole and window-safe
            full, swa = path_slots(tree, keys)
            assert full[: len(keys)] == full_slots
            if h.swa_nodes:
                assert NO_SLOT not in swa[max(0, len(keys) - w):len(keys)]
    for h, _, _ in locks:
        tree.unlock(h)
    tree.evict(10_000, 10_000)
    assert tree.num_nodes == 0 and full_pool.num_free == 400 and swa_pool.num_free == 400


def test_common_len_equals_a_key_by_key_scan():
    """``common_len`` compares slices in blocks; it must give the first mismatch of a plain scan,
    at every offset: inside the first block, past several, at the very end, or none."""
    from llm_svc.kv.radix_node import common_len

    rng = random.Random(11)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        start = rng.randrange(0, 20)
        k = rng.randrange(len(a) + 1)
        b = [rng.randrange(3) for _ in range(start)] + a[:k] + [rng.randrange(3) for _ in range(rng.randrange(0, 50))]
        n, i = min(len(a), len(b) - start), 0
        while i < n and a[i] == b[start + i]:
            i += 1
        assert common_len(a, b, start) == i >= min(k, n)
