"""The dashboard's reduction of /metrics, fed the LLM and encoder services' own metric classes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from encoder_svc.metrics import EncoderMetrics
from gateway.dashboard import DashboardSnapshot, histogram, parse_metrics, snapshot
from gateway.metrics import GatewayMetrics
from llm_svc.front.metrics import LLMMetrics
from llm_svc.types.request import BackendStats

pytestmark = pytest.mark.unit


def _llm_text() -> str:
    m = LLMMetrics()
    m.prompt_tokens.inc(200)
    m.prefix_hit_tokens.inc(50)
    m.generation_tokens.inc(31)
    for s in (0.004, 0.02, 0.02, 3.0):
        m.ttft.observe(s)
    m.itl.observe(0.003)
    m.set_role("decode")
    spec = {"spec_num_spec_tokens": 2, "spec_num_drafts": 10, "spec_num_draft_tokens": 20,
            "spec_num_accepted_tokens": 12, "spec_num_accepted_tokens_per_pos_0": 8,
            "spec_num_accepted_tokens_per_pos_1": 4, "spec_mean_acceptance_length": 2.2}
    spec["handover_adopted"] = 3
    return m.render(BackendStats(running=2, waiting=5, kv_full_usage=0.25, kv_swa_usage=0.5, tiers=spec)).decode()


def _encoder_text() -> str:
    m = EncoderMetrics()
    m.cache_lookups.labels("memory", "image", "hit").inc(3)
    m.cache_lookups.labels("memory", "image", "miss").inc(1)
    m.cache_lookups.labels("redis", "image", "miss").inc(1)
    m.forwards.labels("vision").inc(2)
    m.forward_items.labels("vision").inc(6)
    m.batch_size.labels("vision").observe(4)
    m.batch_size.labels("audio").observe(2)
    return m.render().decode()


def test_histogram_sums_labels_and_quantiles_are_bucket_bounds():
    h = histogram(parse_metrics(_encoder_text()), "encoder_batch_size")
    assert h.count == 2 and h.sum == 6
    assert h.quantile(0.5) == 2 and h.quantile(1.0) == 4
    t = histogram(parse_metrics(_llm_text()), "mmserve_llm_time_to_first_token_seconds")
    assert t.quantile(0.5) == 0.025 and t.quantile(0.99) == 5


def test_snapshot_reduces_every_replica_and_marks_a_dead_one_down():
    texts = {"http://llm-a": _llm_text(), "http://enc-a": _encoder_text()}

    def handler(req: httpx.Request) -> httpx.Response:
        base = f"{req.url.scheme}://{req.url.host}"
        if base not in texts:
            return httpx.Response(503)
        return httpx.Response(200, text=texts[base])

    async def go() -> DashboardSnapshot:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            gw = GatewayMetrics()
            gw.in_flight.inc(3)
            return await snapshot(http, ["http://llm-a", "http://llm-b"], ["http://enc-a"], gw.render().decode())

    snap = asyncio.run(go())
    a, b = snap.llm
    assert (a.up, b.up) == (True, False)
    assert (a.kv_full_usage, a.kv_swa_usage, a.running, a.waiting) == (0.25, 0.5, 2, 5)
    assert (a.prompt_tokens, a.prefix_hit_tokens, a.prefix_hit_rate, a.generation_tokens) == (200, 50, 0.25, 31)
    assert a.ttft.count == 4 and a.itl.count == 1
    assert (a.spec_drafts, a.spec_draft_tokens, a.spec_accepted_tokens) == (10, 20, 12)
    assert a.spec_acceptance_rate == 0.6 and a.spec_mean_acceptance_length == pytest.approx(2.2)
    assert (a.role, a.handovers) == ("decode", 3)  # the role's gauge and the hand-overs it continued from
    assert 'mmserve_llm_spec_decode_num_accepted_tokens_per_pos{position="1"} 4.0' in _llm_text()
    (e,) = snap.encoder
    assert (e.cache_lookups, e.cache_hits, e.cache_hit_rate) == (5, 3, 0.6)
    assert (e.forward_passes, e.forward_items, e.mean_batch_size) == (2, 6, 3.0)
    assert snap.gateway.in_flight == 3
    j = snap.to_json()
    assert j["llm"][0]["ttft"]["le"][-1] is None  # +Inf has no JSON form
    assert j["llm"][1] == {**j["llm"][1], "up": False, "prefix_hit_rate": None, "spec_acceptance_rate": None}


def test_snapshot_carries_the_gateways_and_every_replicas_warnings():
    def handler(req: httpx.Request) -> httpx.Response:
        base = f"{req.url.scheme}://{req.url.host}"
        if req.url.path == "/metrics":
            return httpx.Response(200, text=_llm_text() if "llm" in base else _encoder_text())
        if base == "http://llm-a":
            return httpx.Response(200, json={"status": "ok", "service": "llm", "warnings": ["no token"]})
        if base == "http://enc-a":
            return httpx.Response(503, json={"status": "loading", "service": "encoder", "warnings": ["no enc token"]})
        return httpx.Response(200, text="not json")  # an older replica: no warnings, no failure

    async def go() -> DashboardSnapshot:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await snapshot(http, ["http://llm-a", "http://llm-b"], ["http://enc-a"],
                                  GatewayMetrics().render().decode(), gateway_warnings=["gateway open"])

    snap = asyncio.run(go())
    assert snap.warnings == ["gateway open", "http://llm-a: no token", "http://enc-a: no enc token"]
    assert snap.to_json()["warnings"] == snap.warnings
    assert [r.up for r in snap.llm] == [True, True]
