"""Embedding cache tiers without services: process LRU, host shared memory, tiering."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

from encoder_svc.cache.base import from_bytes, to_bytes
from encoder_svc.cache.memory import MemoryLRU
from encoder_svc.cache.shm import SharedMemoryTier
from encoder_svc.cache.tiered import TieredCache
from encoder_svc.metrics import EncoderMetrics

pytestmark = pytest.mark.unit


def emb(seed: int, rows: int = 4, hidden: int = 8) -> torch.Tensor:
    return torch.full((rows, hidden), float(seed))  # 4 * 8 * 4 = 128 bytes


def run(coro):
    return asyncio.run(coro)


def test_codec_round_trip_and_key_check():
    t = torch.randn(3, 5)
    data = to_bytes("k1", t)
    assert torch.equal(from_bytes("k1", data), t)
    assert from_bytes("k2", data) is None  # another key's value is a miss
    assert from_bytes("k1", data[:20]) is None  # torn value is a miss


def test_memory_lru_budget_and_order():
    lru = MemoryLRU(max_bytes=3 * 128)

    async def go():
        for i in range(3):
            await lru.put(f"k{i}", emb(i))
        assert await lru.get("k0") is not None  # k0 becomes most recent
        await lru.put("k3", emb(3))  # evicts k1, the least recently used
        assert await lru.get("k1") is None
        assert [await lru.get(k) is not None for k in ("k0", "k2", "k3")] == [True, True, True]
        await lru.put("k3", emb(9))  # replace keeps accounting right
        assert (await lru.get("k3"))[0, 0].item() == 9.0
        await lru.put("huge", torch.zeros(1000))  # larger than the budget: not stored
        assert await lru.get("huge") is None

    run(go())
    lru.check_integrity()
    assert lru.nbytes() == 3 * 128 and len(lru) == 3


def test_memory_integrity_detects_bad_accounting():
    lru = MemoryLRU(1000)
    run(lru.put("a", emb(1)))
    lru._bytes += 1
    with pytest.raises(AssertionError):
        lru.check_integrity()


def test_shm_tier_shared_between_instances_and_budget(tmp_path):
    size = len(to_bytes("k0", emb(0)))
    a = SharedMemoryTier(3 * size, tmp_path)
    b = SharedMemoryTier(3 * size, tmp_path)

    async def go():
        await a.put("k0", emb(0))
        got = await b.get("k0")
        assert got is not None and torch.equal(got, emb(0))
        for i in range(1, 5):
            await a.put(f"k{i}", emb(i))
        assert a.nbytes() <= 3 * size
        assert await b.get("k4") is not None

    run(go())
    a.check_integrity()
    a.clear()
    assert a.nbytes() == 0


def _child_put(directory: str, prefix: str, n: int, budget: int) -> None:
    tier = SharedMemoryTier(budget, directory)

    async def go():
        for i in range(n):
            await tier.put(f"{prefix}{i}", torch.full((2, 3), float(i)))

    asyncio.run(go())


def test_shm_tier_shared_across_processes_within_one_budget(tmp_path):
    size = len(to_bytes("a0", torch.zeros(2, 3)))
    budget = 10 * size
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child_put, args=(str(tmp_path), p, 30, budget)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    tier = SharedMemoryTier(budget, tmp_path)
    tier.check_integrity()  # both writers together stayed within the one budget
    assert 0 < tier.nbytes() <= budget
    latest = [run(tier.get(f"{p}29")) for p in ("a", "b")]
    # the process that finished last has its newest entry kept; both oldest entries are gone
    assert any(t is not None and t[0, 0].item() == 29.0 for t in latest)
    assert run(tier.get("a0")) is None and run(tier.get("b0")) is None


def test_tiered_promotes_and_counts(tmp_path):
    m = EncoderMetrics()
    fast, slow = MemoryLRU(10**6), SharedMemoryTier(10**6, tmp_path)
    cache = TieredCache([fast, slow], m)

    async def go():
        await slow.put("k", emb(5))
        assert await fast.get("k") is None
        got = await cache.get("k", "image")
        assert torch.equal(got, emb(5))
        assert await fast.get("k") is not None  # promoted
        assert await cache.get("missing", "video") is None

    run(go())
    val = m.registry.get_sample_value
    assert val("encoder_cache_lookups_total", {"tier": "memory", "modality": "image", "result": "miss"}) == 1
    assert val("encoder_cache_lookups_total", {"tier": "shm", "modality": "image", "result": "hit"}) == 1
    assert val("encoder_cache_lookups_total", {"tier": "shm", "modality": "video", "result": "miss"}) == 1
    assert val("encoder_cache_bytes", {"tier": "memory"}) == 128
    cache.check_integrity()
