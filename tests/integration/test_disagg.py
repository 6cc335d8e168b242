"""Prefill / decode disaggregation on real engines (tiny random-weight MiMo, W = 16): a prompt
runs to its first token on one engine, its hand-over crosses a real TCP stream on 127.0.0.1, and
another engine decodes the rest, token for token what one unified engine gives. The hand-over
moves the full layers' KV and the sliding layers' last W positions only; a corrupted page or a cut
transfer is detected and the prompt recomputed, with the same output; nothing leaks on either side."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from llm_svc.attention import FULL, SLIDING
from llm_svc.disagg.messages import full_attention_bytes, handover_bytes
from llm_svc.disagg.transport import frames
from llm_svc.offload import kv_pack
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from tests.disagg_engines import (LENGTHS, PAGE, W, assert_clean, decode_all, make_engine, preps, prefill_all,
                                  through_tcp, unified)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model", ["mimo16", "gemma16"])  # MiMo: sinks, qk != v; Gemma 3: soft-cap
def test_prefill_handover_over_tcp_then_decode_equals_unified(model, request):
    lm = request.getfixturevalue(model)
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
    foreign = [msgspec.structs.replace(h, fingerprint="0" * 16) for h in handovers]
    de, dside, adopted, got, _ = decode_all(lm, reqs, foreign)
    assert adopted == {"r0": False} and dside.fallbacks == {"fingerprint": 1}
    assert [handovers[0].first_token] + got["r0"] == want["r0"]
    assert_clean(pe, de, sides=(dside,))


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

