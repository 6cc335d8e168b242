"""Two LLM services (engine cores in their own processes, real HTTP) sharing one real Redis as
their L3 KV tier: a conversation's next turn sent to the other replica hits there."""

from __future__ import annotations

import time

import httpx
import pytest

from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from tests.integration.test_llm_service import _metric, post, start_service

pytestmark = pytest.mark.integration
REDIS = "redis://127.0.0.1:6379/0"


def chat(rid: str, turns: list[tuple[str, str]], max_tokens: int = 8) -> GenerateRequest:
    msgs = [PromptMessage(role="system", content=[PromptText(text="you are a careful assistant. " * 12)])]
    msgs += [PromptMessage(role=r, content=[PromptText(text=t)]) for r, t in turns]
    return GenerateRequest(request_id=rid, messages=msgs,
                           sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def wait_metric(svc, name, label, at_least, timeout=10.0) -> float:
    deadline = time.monotonic() + timeout
    v = _metric(svc, name, label)
    while v < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
        v = _metric(svc, name, label)
    return v


def test_next_turn_on_the_other_replica_hits_l3(mimo_bundle):
    kw = dict(kv_l3_url=REDIS, kv_l3_ttl_s=600, kv_l3_page_tokens=32)
    with start_service(mimo_bundle, "swa", **kw) as a, start_service(mimo_bundle, "swa", **kw) as b:
        user1 = f"tell me about replica routing {time.time_ns()}"  # a fresh conversation every run
        t1 = post(a, chat("t1", [("user", user1)]), {}).json()
        assert t1["prompt_tokens"] >= 64
        assert wait_metric(a, "mmserve_llm_kv_l3_events", 'event="pages_written"', 1) >= 1
        time.sleep(0.3)  # the writes are asynchronous: let them land
        turns = [("user", user1), ("assistant", t1["text"]), ("user", "and then?")]
        on_b = post(b, chat("t2b", turns), {}).json()
        assert on_b["cached_tokens"] >= t1["prompt_tokens"] // 32 * 32 > 0, (on_b, t1)
        assert wait_metric(b, "mmserve_llm_kv_l3_events", 'event="hits"', 1) >= 1
        on_a = post(a, chat("t2a", turns), {}).json()  # what the first replica gives (its own cache)
        assert on_b["token_ids"] == on_a["token_ids"]
        assert _metric(b, "mmserve_llm_kv_l3_up") == 1
        assert httpx.get(b.url + "/readyz", timeout=5).status_code == 200
