"""The tiered radix tree (device + host pools) under random operations, with a simulated memory:
every copy the tree records is replayed, and every hit must read exactly the KV that was
computed for its keys. ``check_integrity`` after every operation."""

from __future__ import annotations

import random

import pytest

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import NO_SLOT, RadixCache

pytestmark = pytest.mark.unit


class Memory:
    """What each slot of each pool holds: the key prefix its KV was computed from."""

    def __init__(self) -> None:
        self.mem = {"full": {}, "swa": {}, "host_full": {}, "host_swa": {}}

    def apply(self, ops) -> None:
        where = {"h2d_full": ("host_full", "full"), "h2d_swa": ("host_swa", "swa"),
                 "d2h_full": ("full", "host_full"), "d2h_swa": ("swa", "host_swa")}
        for kind, src, dst in ops:
            a, b = where[kind]
            assert len(src) == len(dst)
            vals = [self.mem[a][s] for s in src]  # read all first: a copy is one transfer
            for d, v in zip(dst, vals):
                self.mem[b][d] = v


def make(rng, host_full=120, host_swa=60):
    w = rng.choice([2, 3, 5])
    pools = [SlotPool(60, "full"), SlotPool(40, "swa"), SlotPool(host_full, "host_full"),
             SlotPool(host_swa, "host_swa")]
    return w, pools, RadixCache(w, *pools)


def check_hit(tree, mem, keys, m, w):
    for p in range(m.length):
        assert mem.mem["full"][m.full_slots[p]] == tuple(keys[:p + 1]), "hit reads other full KV"
    for p in range(max(0, m.length - w), m.length):
        assert m.swa_slots[p] != NO_SLOT
        assert mem.mem["swa"][m.swa_slots[p]] == tuple(keys[:p + 1]), "hit reads other SWA KV"


@pytest.mark.parametrize("seed", range(6))
def test_random_tiered_ops_read_what_was_computed(seed):
    rng = random.Random(seed)
    w, (full_pool, swa_pool, hf_pool, hs_pool), tree = make(rng)
    mem = Memory()
    locks = []
    stats = {"loads": 0, "host_inserts": 0}

    def rand_keys():
        return [rng.randrange(3) for _ in range(rng.randint(1, 16))]

    for _ in range(700):
        op = rng.random()
        if op < 0.4:
            keys = rand_keys()
            m = tree.match_prefix(keys)
            h = tree.lock(m)
            if m.needs_load:
                if not tree.load(m):
                    tree.unlock(h)
                    m = tree.match_prefix(keys, device_only=True)
                    h = tree.lock(m)
                else:
                    stats["loads"] += 1
            n_new = len(keys) - m.length
            short_f = n_new - full_pool.num_free
            short_s = n_new - swa_pool.num_free
            if short_f > 0 or short_s > 0:
                tree.evict(max(0, short_f), max(0, short_s))
            full = full_pool.alloc(n_new)
            swa_new = swa_pool.alloc(n_new)
            mem.apply(tree.take_ops())  # copies run before the forward writes
            check_hit(tree, mem, keys, m, w)
            if full is None or swa_new is None:
                full_pool.free(full or [])
                swa_pool.free(swa_new or [])
                tree.unlock(h)
                tree.check_integrity()
                continue
            for i, p in enumerate(range(m.length, len(keys))):  # the forward
                mem.mem["full"][full[i]] = mem.mem["swa"][swa_new[i]] = tuple(keys[:p + 1])
            mask = [rng.random() < 0.5 or i >= n_new - w for i in range(n_new)]
            kept = [s if k else NO_SLOT for s, k in zip(swa_new, mask)]
            swa_pool.free([s for s, k in zip(swa_new, mask) if not k])
            tree.insert(keys, m.full_slots + full, m.swa_slots + kept, owned_from=m.length)
            tree.unlock(h)
        elif op < 0.55:
            # KV arriving from a lower tier: the known content of a prefix
            keys = rand_keys()
            raw = tree.peek_raw_len(keys)
            got = tree.insert_host(keys, full_from=rng.randint(0, raw), window_from=max(0, len(keys) - w))
            mem.apply(tree.take_ops())
            if got is not None:
                stats["host_inserts"] += 1
                for p, s in got[0]:
                    mem.mem["host_full"][s] = tuple(keys[:p + 1])
                for p, s in got[1]:
                    mem.mem["host_swa"][s] = tuple(keys[:p + 1])
                assert tree.peek_match_len(keys) == len(keys)
        elif op < 0.7:
            keys = rand_keys()
            m = tree.match_prefix(keys)
            if m.needs_load:
                h = tree.lock(m)
                ok = tree.load(m)
                mem.apply(tree.take_ops())
                if ok:
                    check_hit(tree, mem, keys, m, w)
                    locks.append((h, keys[:m.length], list(m.full_slots)))
                else:
                    tree.unlock(h)
            else:
                check_hit(tree, mem, keys, m, w)
        elif op < 0.8 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks)))[0])
        else:
            tree.evict(rng.randint(0, 25), rng.randint(0, 25))
            mem.apply(tree.take_ops())
        tree.check_integrity()
        for pool, owned in ((full_pool, tree.owned_slots()[0]), (swa_pool, tree.owned_slots()[1]),
                            (hf_pool, tree.owned_host_slots()[0]), (hs_pool, tree.owned_host_slots()[1])):
            assert sorted(owned + pool.free_slots()) == list(range(pool.num_slots)), pool.name
        for h, keys, full_slots in locks:  # pinned prefixes stay whole on the device
            m = tree.match_prefix(keys, device_only=True)
            assert m.full_slots[:len(keys)] == full_slots
    assert stats["loads"] > 0 and stats["host_inserts"] > 0
    assert tree.stats["demoted_full"] > 0 and tree.stats["host_evictions"] > 0
    for h, _, _ in locks:
        tree.unlock(h)
    tree.evict(10_000, 10_000)
    assert full_pool.num_free == 60 and swa_pool.num_free == 40


def test_demoted_prefix_comes_back_from_host_exactly():
    pools = [SlotPool(8, "full"), SlotPool(8, "swa"), SlotPool(32, "host_full"), SlotPool(32, "host_swa")]
    tree = RadixCache(2, *pools)
    mem = Memory()
    keys = [1, 2, 3, 4, 5, 6]
    full, swa = pools[0].alloc(6), pools[1].alloc(6)
    for p in range(6):
        mem.mem["full"][full[p]] = mem.mem["swa"][swa[p]] = tuple(keys[:p + 1])
    tree.insert(keys, full, swa)
    assert tree.evict(6, 0)[0] == 6  # all demoted
    mem.apply(tree.take_ops())
    assert tree.full_tokens == 0 and tree.host_full_tokens == 6 and tree.host_swa_tokens == 6
    assert tree.peek_match_len(keys) == 6
    assert tree.match_prefix(keys, device_only=True).length == 0
    for p in range(6):  # scribble over the freed device slots
        mem.mem["full"][p] = mem.mem["swa"][p] = ("junk",)
    m = tree.match_prefix(keys)
    h = tree.lock(m)
    assert m.needs_load and tree.load(m)
    ops = tree.take_ops()
    assert [k for k, _, _ in ops] == ["h2d_full", "h2d_swa"] and len(ops[1][1]) == 2  # SWA: the window only
    mem.apply(ops)
    check_hit(tree, mem, keys, m, 2)
    tree.unlock(h)
    tree.check_integrity()


def test_no_host_tier_drops_as_before():
    tree = RadixCache(2, SlotPool(8, "full"), SlotPool(8, "swa"))
    full, swa = tree.device.full_pool.alloc(4), tree.device.swa_pool.alloc(4)
    tree.insert([1, 2, 3, 4], full, swa)
    tree.evict(4, 0)
    assert tree.num_nodes == 0 and tree.take_ops() == [] and tree.insert_host([1, 2], 0, 0) is None
