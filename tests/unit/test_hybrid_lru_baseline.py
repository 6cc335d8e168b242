"""The vLLM-v1-like hybrid manager baseline of benchmarks.prefix_reuse behaves as modelled."""

from __future__ import annotations

import pytest

from benchmarks._hybrid_lru import BLOCK, HybridLRU
from llm_svc.types.request import Request
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit
W = 32  # two blocks of window


def run(sim: HybridLRU, rid: str, prompt: list[int], out: int = 3) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True))
    sim.add(req)
    while rid in sim.requests:
        batch = sim.schedule()
        assert batch is not None
        sim.postprocess(batch, sim.run(batch))
        sim.check_integrity()
    return req


def make(pages: int) -> HybridLRU:
    return HybridLRU(pages, W, swa_groups=6, max_batch_tokens=64, max_running=4, next_token=lambda r: 7)


def test_follow_up_turn_hits_its_whole_block_aligned_prefix_when_nothing_evicts():
    sim = make(1000)
    a = run(sim, "a", list(range(1, 101)))
    b = run(sim, "b", a.all_ids + list(range(500, 540)))
    assert b.num_cached_tokens == (len(a.all_ids) // BLOCK) * BLOCK
    assert sim._free_pages() == sim.total  # idle: every page back in the free queue


def test_out_of_window_swa_blocks_are_freed_while_running():
    sim = make(1000)
    req = Request("a", list(range(1, 161)), SamplingParams(max_tokens=2, ignore_eos=True))
    sim.add(req)
    sim.postprocess(b := sim.schedule(), sim.run(b))  # 64 tokens computed
    st = sim._st["a"]
    assert len(st.full) == 4 and sorted(st.swa) == [2, 3]  # only the window's blocks keep SWA pages


def test_recycling_the_tail_first_collapses_the_hit_though_most_blocks_stay_cached():
    """vllm #48435's collapse: the LRU head holds the SWA blocks freed eagerly, then the finished
    request's full blocks tail first. Losing those SWA blocks and one full tail block leaves 5
    full blocks and the last SWA window cached, yet no prefix of them is a hit."""
    sim = make(60)
    a = run(sim, "a", list(range(1, 97)))  # 99 tokens: complete blocks 0..5
    h = sim._chain(a.all_ids, 6, [])
    order = list(sim.free_queue)
    assert order[:4] == [("s", h[j]) for j in range(4)]  # freed while running
    assert order[4:10] == [("f", h[j]) for j in (5, 4, 3, 2, 1, 0)]  # then the full blocks, tail first
    assert sim._take(sim.uncached_free + 4 * 6 + 1)  # pressure: those SWA blocks and f5 are recycled
    assert [("f", h[j]) in sim.refs for j in range(6)] == [True] * 5 + [False]
    assert ("s", h[4]) in sim.refs and ("s", h[5]) in sim.refs
    sim.uncached_free = sim.total - sum(sim.free_queue.values())  # give the pages back (no request holds any)
    b = run(sim, "b", a.all_ids + [9, 9, 9])
    assert b.num_cached_tokens == 0
