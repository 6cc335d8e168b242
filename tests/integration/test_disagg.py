"""Prefill / decode disaggregation on real engines (tiny random-weight MiMo, W = 16): a prompt
runs to its first token on one engine, its hand-over crosses a real TCP stream on 127.0.0.1, and
another engine decodes the rest, token for token what one unified engine gives. The hand-over
moves the full layers' KV and the sliding layers' last W positions only; a corrupted page or a cut
transfer is detected and the prompt recomputed, with the same output; nothing leaks on either side."""

from __future__ import annotations

import asyncio

import pytest
import torch

from llm_svc.attention import FULL, SLIDING
from llm_svc.core.convert import request_from_core, to_core_add
from llm_svc.disagg.decode import DecodeSide
from llm_svc.disagg.messages import full_attention_bytes, handover_bytes
from llm_svc.disagg.prefill import PrefillConfig, PrefillSide, kv_fingerprint
from llm_svc.disagg.transport import TcpReceiver, TcpSender, frames
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.engine.spec import SpeculativeConfig
from llm_svc.engine.speculate import Speculator
from llm_svc.models import build_model
from llm_svc.offload import kv_pack
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from tests.conftest import SMALL_W

pytestmark = pytest.mark.integration
W = SMALL_W
PAGE = 16
LENGTHS = (101, 40, 7)  # past the window by several windows (a short last page), past it, inside it


def make_engine(lm, num_full=700, extra_swa=40, spec: dict | None = None) -> Engine:
    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(window=model.window, max_batch_tokens=48, max_running=6)
    num_swa = cfg.min_swa_slots() + extra_swa
    runner = ModelRunner(model, num_full, num_swa)
    sc = SpeculativeConfig.parse(spec)
    speculator = None
    if sc is not None:
        mtp = None
        if sc.method == "mtp":
            from llm_svc.engine.mtp_runner import MTPRunner

            sc = sc.with_mtp_layers(len(lm.model.mtp))
            mtp = MTPRunner(runner, lm.model.mtp[:sc.num_speculative_tokens], lm.model.get_input_embeddings(),
                            lm.model.get_output_embeddings(), model.window)
        speculator = Speculator(sc, lm.eos_token_ids, mtp)
    return Engine(runner, Scheduler(cfg, num_full, num_swa), lm.eos_token_ids, speculator=speculator)


def preps(lm, seed=0, max_tokens=10) -> list[PreparedRequest]:
    g = torch.Generator().manual_seed(seed)
    return [PreparedRequest(request_id=f"r{i}", prompt_ids=torch.randint(20, lm.vocab_size, (n,), generator=g).tolist(),
                            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, n in enumerate(LENGTHS)]


def request(engine: Engine, prep: PreparedRequest):
    return request_from_core(to_core_add(prep, epoch=0), engine.runner.device, None, engine.eos_token_ids)


def drain(engine: Engine, step=None, max_steps=2000) -> dict[str, list[int]]:
    """Step until idle; request id -> its emitted token ids (the integrity checked every step)."""
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for t in (step or engine.step)():
            assert t.error is None, t.error
            if t.token_id is not None:
                out.setdefault(t.request_id, []).append(t.token_id)
        engine.scheduler.check_integrity()
    raise AssertionError("engine did not finish")


def unified(lm, reqs, spec: dict | None = None) -> dict[str, list[int]]:
    e = make_engine(lm, spec=spec)
    for p in reqs:
        e.add(request(e, p))
    return drain(e)


def prefill_all(lm, reqs, engine: Engine | None = None):
    e = engine or make_engine(lm)
    side = PrefillSide(e, PrefillConfig(PAGE, kv_fingerprint(e)))
    for p in reqs:
        side.add(request(e, p))
    handovers = []
    for _ in range(2000):
        if not side.has_work():
            break
        got = side.step()
        assert not got.failed
        handovers.extend(got.handovers)
        e.scheduler.check_integrity()
    assert sorted(h.request_id for h in handovers) == sorted(p.request_id for p in reqs)
    return e, side, handovers


async def through_tcp(handovers, cut: dict[str, int] | None = None):
    """Every hand-over over one loopback connection; ``cut``: request id -> bytes of its frames
    to send before closing the connection (a transfer that stops half-way)."""
    rx = await TcpReceiver.listen("127.0.0.1", 0)
    try:
        if cut:
            (rid, keep), = cut.items()
            h = next(h for h in handovers if h.request_id == rid)
            _, writer = await asyncio.open_connection("127.0.0.1", rx.port)
            writer.write(b"".join(frames(h))[:keep])
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            handovers = [h for h in handovers if h.request_id != rid]
            got = [await asyncio.wait_for(rx.receive(), 10)]
        else:
            got = []
        tx = await TcpSender.connect("127.0.0.1", rx.port)
        for h in handovers:
            await tx.send(h)
        got += [await asyncio.wait_for(rx.receive(), 10) for _ in handovers]
        await tx.close()
        return got, tx.bytes_sent
    finally:
        await rx.close()


def decode_all(lm, reqs, handovers, spec: dict | None = None):
    e = make_engine(lm, spec=spec)
    side = DecodeSide(e, kv_fingerprint(e))
    by_id = {p.request_id: p for p in reqs}
    adopted = {h.request_id: side.add(request(e, by_id[h.request_id]), h) for h in handovers}
    cached: dict[str, int] = {}

    def step():
        outs = side.step()
        for t in outs:
            cached.setdefault(t.request_id, t.num_cached_tokens)
        return outs

    return e, side, adopted, drain(e, step), cached


def assert_clean(*engines: Engine, sides: tuple[DecodeSide, ...] = ()) -> None:
    assert all(side.num_held == 0 for side in sides)  # every adopted prefix's lock released
    for e in engines:
        e.scheduler.check_integrity()
        st = e.scheduler.stats()
        assert st["running"] == st["waiting"] == 0 and e.num_live == 0
        assert st["full_free"] + st["full_cached"] == st["full_total"], st  # no slot leaked
        assert st["swa_free"] + st["swa_cached"] == st["swa_total"], st


def test_prefill_handover_over_tcp_then_decode_equals_unified(mimo16):
    lm = mimo16
    reqs = preps(lm)
    want = unified(lm, reqs)
    pe, pside, handovers = prefill_all(lm, reqs)
    received, sent = asyncio.run(through_tcp(handovers))
    de, dside, adopted, got, cached = decode_all(lm, reqs, received)
    assert all(adopted.values()) and dside.num_fallbacks == 0, dside.fallbacks
    for h in received:
        rid, n = h.request_id, len(h.prompt_ids)
        assert [h.first_token] + got[rid] == want[rid], rid
        assert cached[rid] == n  # decoded from the handed-over KV: nothing of the prompt recomputed
    # what moved: full layers for every prompt token, sliding layers for the last W only
    kinds = [s.kind for s in de.runner.model.layers]
    f = kv_pack.token_bytes(de.runner.kv, kinds, FULL)
    s = kv_pack.token_bytes(de.runner.kv, kinds, SLIDING)
    assert f > 0 and s > 0
    for h in received:
        n = len(h.prompt_ids)
        assert h.kv_bytes == handover_bytes(n, f, s, W) == n * f + min(n, W) * s
        ratio = h.kv_bytes / full_attention_bytes(n, f, s)
        assert ratio == pytest.approx((f + min(n, W) / n * s) / (f + s))
        if n > W:
            assert ratio < 1
    long = next(h for h in received if len(h.prompt_ids) == max(LENGTHS))
    assert len(long.pages) == -(-max(LENGTHS) // PAGE) + 1  # the full pages, the last one short, and the window
    assert sent >= sum(h.kv_bytes for h in handovers)  # every KV byte crossed the socket (plus the heads)
    assert pside.stats["handover_kv_bytes"] == dside.stats["adopted_kv_bytes"] == sum(h.kv_bytes for h in received)
    assert_clean(pe, de, sides=(dside,))


def test_corrupt_page_and_cut_transfer_recompute_with_the_same_output(mimo16):
    lm = mimo16
    reqs = preps(lm, seed=1)
    want = unified(lm, reqs)
    pe, _, handovers = prefill_all(lm, reqs)
    bad_id, cut_id = "r0", "r1"
    bad = next(h for h in handovers if h.request_id == bad_id)
    page = bad.pages[2]
    flipped = bytearray(page.data)
    flipped[len(flipped) // 2] ^= 0x01
    import msgspec
    bad = msgspec.structs.replace(bad, pages=[*bad.pages[:2], msgspec.structs.replace(page, data=bytes(flipped)),
                                              *bad.pages[3:]])
    others = [bad if h.request_id == bad_id else h for h in handovers]
    cut_h = next(h for h in handovers if h.request_id == cut_id)
    keep = len(frames(cut_h)[0]) + cut_h.pages[0].nbytes + 100  # the head, one page and a bit of the next
    received, _ = asyncio.run(through_tcp(others, cut={cut_id: keep}))
    by_id = {h.request_id: h for h in received}
    cut_rx = by_id[cut_id]
    assert len(cut_rx.pages[1].data) == 100 and all(not p.data for p in cut_rx.pages[2:])
    de, dside, adopted, got, cached = decode_all(lm, reqs, received)
    assert adopted == {"r0": False, "r1": False, "r2": True}
    assert dside.fallbacks == {"digest": 1, "truncated": 1}
    for rid in want:
        assert [by_id[rid].first_token] + got[rid] == want[rid], rid
    assert cached["r0"] == cached["r1"] == 0 and cached["r2"] == LENGTHS[2]  # the bad ones recomputed
    assert_clean(pe, de, sides=(dside,))


def test_a_handover_from_another_geometry_is_recomputed(mimo16):
    lm = mimo16
    reqs = preps(lm, seed=2)[:1]
    want = unified(lm, reqs)
    pe, _, handovers = prefill_all(lm, reqs)
    import msgspec
    foreign = [msgspec.structs.replace(h, fingerprint="0" * 16) for h in handovers]
    de, dside, adopted, got, _ = decode_all(lm, reqs, foreign)
    assert adopted == {"r0": False} and dside.fallbacks == {"fingerprint": 1}
    assert [handovers[0].first_token] + got["r0"] == want["r0"]
    assert_clean(pe, de, sides=(dside,))


def test_adoption_that_evicts_to_the_host_tier_keeps_every_cached_prefix_right(mimo16):
    """A decode engine whose pools are full of other prompts' KV: adopting a hand-over evicts some
    of it to the host tier, and the demotions copy it down before the hand-over overwrites those
    slots (a returning prompt loaded back from the host still gives the unified engine's tokens)."""
    from llm_svc.offload.host_kv import HostKV
    from llm_svc.offload.tiers import KVTiers

    lm = mimo16
    first, second = preps(lm, seed=3), preps(lm, seed=4)
    second = [PreparedRequest(request_id=f"b{i}", prompt_ids=p.prompt_ids, sampling=p.sampling)
              for i, p in enumerate(second)]
    want = unified(lm, first + second)
    _, _, handovers = prefill_all(lm, second)
    cfg = SchedulerConfig(window=W, max_batch_tokens=48, max_running=6)
    num_full, num_swa = 200, cfg.min_swa_slots() + 40
    model = build_model(lm.arch, lm.model)
    runner = ModelRunner(model, num_full, num_swa)
    sched = Scheduler(cfg, num_full, num_swa, num_host_full=2000, num_host_swa=400)
    tiers = KVTiers(sched.kv, HostKV(runner.kv, [s.kind for s in model.layers], 2000, 400), None)
    e = Engine(runner, sched, lm.eos_token_ids, tiers=tiers)
    for p in first:
        e.add(request(e, p))
    got = drain(e)
    side = DecodeSide(e, kv_fingerprint(e))
    by_id = {p.request_id: p for p in second}
    assert all(side.add(request(e, by_id[h.request_id]), h) for h in handovers)
    got.update(drain(e, side.step))
    assert e.stats()["tree_demoted_full"] > 0  # adoption (and the decodes) pushed the first prompts down
    again = [PreparedRequest(request_id=f"{p.request_id}-again", prompt_ids=p.prompt_ids, sampling=p.sampling)
             for p in first]
    for p in again:
        e.add(request(e, p))
    got.update(drain(e, side.step))
    assert e.stats()["tree_loaded_full"] > 0  # some came back from the host tier
    for h in handovers:
        assert [h.first_token] + got[h.request_id] == want[h.request_id]
    for p in first:
        assert got[p.request_id] == got[f"{p.request_id}-again"] == want[p.request_id]
    assert_clean(e, sides=(side,))


def test_prefix_hits_on_the_prefill_side_and_ngram_drafts_on_the_decode_side(mimo16):
    """The second wave of prompts shares long prefixes with the first: the prefill engine serves
    them from its prefix tree and still hands over the whole prompt's KV; the decode engine
    speculates (n-gram, k = 4) from the adopted prefix; greedy output equals the unified engine's."""
    lm = mimo16
    base = preps(lm, seed=5, max_tokens=16)
    g = torch.Generator().manual_seed(6)
    follow = [PreparedRequest(request_id=f"{p.request_id}-next", sampling=p.sampling,
                              prompt_ids=p.prompt_ids[:-2] + torch.randint(20, lm.vocab_size, (23,), generator=g).tolist())
              for p in base]
    want = unified(lm, base + follow)
    pe = make_engine(lm)
    _, _, first = prefill_all(lm, base, pe)
    _, pside, second = prefill_all(lm, follow, pe)
    assert pe.scheduler.stats()["cached_tokens"] > 0  # the follow-ups hit the prefill engine's tree
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
             "draft_policy": "fixed"}
    received, _ = asyncio.run(through_tcp(first + second))
    de, dside, adopted, got, cached = decode_all(lm, base + follow, received, spec=ngram)
    assert all(adopted.values()) and dside.num_fallbacks == 0
    for h in received:
        assert [h.first_token] + got[h.request_id] == want[h.request_id], h.request_id
        assert cached[h.request_id] == len(h.prompt_ids)
    assert de.stats()["spec_num_drafts"] > 0  # the decode side did speculate
    assert_clean(pe, de, sides=(dside,))


def test_an_adopted_prefix_is_not_evicted_before_its_request_is_admitted(mimo16):
    """Eviction between the adoption and the request's admission (pools under pressure) cannot
    take the adopted KV: it stays locked until the request holds it, then is released."""
    lm = mimo16
    reqs = preps(lm, seed=7)[:1]
    want = unified(lm, reqs)
    pe, _, handovers = prefill_all(lm, reqs)
    e = make_engine(lm)
    side = DecodeSide(e, kv_fingerprint(e))
    assert side.add(request(e, reqs[0]), handovers[0])
    kv = e.scheduler.kv
    n = len(reqs[0].prompt_ids)
    assert side.num_held == 1 and kv.tree.full_tokens == n
    kv.tree.evict(kv.full_pool.num_slots, kv.swa_pool.num_slots)  # everything evictable goes
    assert kv.tree.full_tokens == n  # but not the adopted prompt
    cached: dict[str, int] = {}

    def step():
        outs = side.step()
        for t in outs:
            cached.setdefault(t.request_id, t.num_cached_tokens)
        return outs

    got = drain(e, step)
    assert [handovers[0].first_token] + got["r0"] == want["r0"] and cached["r0"] == n
    assert_clean(pe, e, sides=(side,))


def test_an_adopted_request_aborted_before_admission_leaks_nothing(mimo16):
    lm = mimo16
    reqs = preps(lm, seed=8)[:1]
    pe, _, handovers = prefill_all(lm, reqs)
    e = make_engine(lm)
    side = DecodeSide(e, kv_fingerprint(e))
    assert side.add(request(e, reqs[0]), handovers[0])
    e.abort("r0")
    outs = side.step()
    assert [(t.request_id, t.finish_reason) for t in outs] == [("r0", "abort")]
    assert_clean(pe, e, sides=(side,))
    assert e.scheduler.kv.tree.evictable_full() == len(reqs[0].prompt_ids)  # the adopted KV is plain cache now


def test_seeded_sampling_through_a_handover_equals_unified(mimo16):
    """A seeded sampled request draws one uniform a token from its own generator: the decode side
    skips the draw the prefill side made for the first token, so every later token is the unified
    engine's."""
    lm = mimo16
    reqs = [PreparedRequest(request_id=p.request_id, prompt_ids=p.prompt_ids,
                            sampling=SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=1000 + i))
            for i, p in enumerate(preps(lm, seed=9))]
    want = unified(lm, reqs)
    pe, _, handovers = prefill_all(lm, reqs)
    de, dside, adopted, got, _ = decode_all(lm, reqs, handovers)
    assert all(adopted.values())
    for h in handovers:
        assert [h.first_token] + got[h.request_id] == want[h.request_id], h.request_id
    assert_clean(pe, de, sides=(dside,))


@pytest.fixture(scope="module")
def mimo_mtp(tmp_path_factory):
    """The tiny published-layout MiMo-V2.5 with its 3 MTP layers, window 32."""
    from llm_svc.loading.loader import load_lm
    from mmserve.tiny_model import write_tiny_model

    return load_lm(str(write_tiny_model(tmp_path_factory.mktemp("b") / "v25", arch="mimo-v2.5", sliding_window=32)))


def test_mtp_speculation_on_the_decode_side_keeps_the_output(mimo_mtp):
    """The MTP layers' KV of the prompt is not handed over (their drafts are weaker for a window);
    verification keeps the output the unified engine's, with and without MTP there."""
    lm = mimo_mtp
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "draft_policy": "fixed"}
    reqs = preps(lm, seed=10, max_tokens=24)
    want = unified(lm, reqs)
    assert unified(lm, reqs, spec=mtp) == want
    pe, _, handovers = prefill_all(lm, reqs)
    assert handovers[0].window == 32 and handovers[0].pages[-1].tokens == 32
    de, dside, adopted, got, cached = decode_all(lm, reqs, handovers, spec=mtp)
    assert all(adopted.values())
    for h in handovers:
        assert [h.first_token] + got[h.request_id] == want[h.request_id], h.request_id
        assert cached[h.request_id] == len(h.prompt_ids)
    assert de.stats()["spec_num_drafts"] > 0
    assert_clean(pe, de, sides=(dside,))


def test_a_decode_engine_without_prefix_cache_recomputes_and_a_prefill_engine_serves_its_own_requests(mimo16):
    lm = mimo16
    reqs = preps(lm, seed=11)
    want = unified(lm, reqs)
    pe = make_engine(lm)
    side = PrefillSide(pe, PrefillConfig(PAGE, kv_fingerprint(pe)))
    side.add(request(pe, reqs[0]))
    for p in reqs[1:]:  # a "both" replica: requests served here beside the ones handed over
        pe.add(request(pe, p))
    handovers, own = [], {}
    while side.has_work():
        got = side.step()
        handovers += got.handovers
        for t in got.outputs:
            own.setdefault(t.request_id, []).append(t.token_id)
    assert [h.request_id for h in handovers] == ["r0"]
    assert own == {p.request_id: want[p.request_id] for p in reqs[1:]}
    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(window=W, max_batch_tokens=48, max_running=6, enable_prefix_cache=False)
    num_swa = cfg.min_swa_slots() + 40
    de = Engine(ModelRunner(model, 700, num_swa), Scheduler(cfg, 700, num_swa), lm.eos_token_ids)
    dside = DecodeSide(de, kv_fingerprint(de))
    assert not dside.add(request(de, reqs[0]), handovers[0])
    assert dside.fallbacks == {"no_prefix_cache": 1}
    got = drain(de, dside.step)
    assert [handovers[0].first_token] + got["r0"] == want["r0"]
    assert_clean(pe, sides=(dside,))
    de.scheduler.check_integrity()
