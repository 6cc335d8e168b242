"""KV events end to end: two LLM services (tiny model, engine cores in their own processes)
publish what their prefix trees hold on a real Redis (one server, then a Redis Cluster); two
gateways fold the events and route a conversation alike, before and after the replica holding it
evicts it (real HTTP throughout)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread, free_port_url
from llm_svc.front.app import create_app as llm_app
from shared.prefix_keys import prefix_blocks
from shared.redis_client import sync_client
from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from shared.settings import GatewaySettings, LLMSettings
from tests.integration.test_llm_service import _metric, post

pytestmark = pytest.mark.integration

SYSTEM = "you answer questions about routing in one short line. " * 3


def messages(turns: list[tuple[str, str]]) -> list[PromptMessage]:
    return [PromptMessage(role="system", content=[PromptText(text=SYSTEM)])] + [
        PromptMessage(role=r, content=[PromptText(text=t)]) for r, t in turns]


def direct(svc: ServerThread, rid: str, turns: list[tuple[str, str]]) -> dict:
    req = GenerateRequest(request_id=rid, messages=messages(turns), sampling=SamplingParams(max_tokens=1))
    r = post(svc, req, {})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ready(svc: ServerThread) -> bool:
    r = httpx.get(svc.url + "/readyz", timeout=5)
    assert r.json()["status"] != "error", r.text
    return r.status_code == 200


def snapshot_keys(svc: ServerThread) -> set[int]:
    return set(httpx.get(svc.url + "/kv/snapshot", timeout=5).json()["keys"])


def requests_served(svc: ServerThread) -> float:
    return _metric(svc, "mmserve_llm_requests_total")


def test_two_gateways_route_alike_on_kv_events_after_an_eviction(mimo_bundle, any_redis_url):
    redis_url = any_redis_url
    stream = f"test:kv-events:{uuid.uuid4().hex}"
    # a small device pool and no host tier: a few prompts evict everything unlocked
    llm_settings = LLMSettings(model_dir=str(mimo_bundle), max_model_len=512, kv_bytes=2 * 1024 * 1024,
                               swa_fraction=0.8, host_kv_full_bytes=0, host_kv_swa_bytes=0, kv_events_url=redis_url,
                               kv_events_stream=stream)
    a, b = ServerThread(llm_app(llm_settings)).start(), ServerThread(llm_app(llm_settings)).start()
    gws: list[ServerThread] = []
    try:
        for svc in (a, b):
            wait_for(lambda svc=svc: ready(svc), "LLM ready", 120)
        topic = uuid.uuid4().hex
        turn1 = [("user", f"conversation {topic}: how does a prefix cache pick a replica for a long chat?")]
        turn2 = turn1 + [("assistant", "by the longest cached prefix"), ("user", "and when that replica evicts it?")]
        turn3 = turn2 + [("assistant", "another one takes over"), ("user", "which one?")]
        direct(b, "t1", turn1)  # b holds the first turn
        direct(a, "t2", turn2)  # a holds the longer second one
        k1, k2 = prefix_blocks(messages(turn1)), prefix_blocks(messages(turn2))
        wait_for(lambda: set(k2[:-1]) <= snapshot_keys(a) and set(k1[:-1]) <= snapshot_keys(b), "KV events stored")

        gw_settings = GatewaySettings(model_name="m", encoder_urls=[free_port_url()], llm_urls=[a.url, b.url],
                                      dns_interval=0, health_interval=0.2, connect_timeout=2,
                                      kv_events_url=redis_url, kv_events_stream=stream, router_recent_s=0)
        gws = [ServerThread(gateway_app(gw_settings)).start() for _ in range(2)]
        feeds = [gw.server.config.app.state.gateway.kv_feed for gw in gws]
        r = sync_client(redis_url)

        def caught_up() -> bool:  # every gateway has loaded both replicas and read every event
            return all(f.connected and len(f.index.instances()) == 2 and not f.index.stale()
                       and f.index.seq(next(iter(f.replicas()))) is not None for f in feeds) \
                and all(all(f.index.seq(i) == seq_of(i) for i in f.index.instances()) for f in feeds)

        def seq_of(instance: str) -> int:
            return max((int(fields[b"s"]) for _, fields in r.xrange(stream) if fields[b"i"].decode() == instance),
                       default=0)

        wait_for(caught_up, "the gateways to follow both replicas")

        def routed(gw: ServerThread, turns) -> ServerThread:
            before = {s: requests_served(s) for s in (a, b)}
            body = {"model": "m", "max_tokens": 1,
                    "messages": [{"role": m.role, "content": m.content[0].text} for m in messages(turns)]}
            resp = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            (served,) = [s for s in (a, b) if requests_served(s) > before[s]]
            return served

        assert [routed(gw, turn3) for gw in gws] == [a, a], "both gateways pick the replica holding the most"

        shared = set(prefix_blocks(messages([("user", "unrelated")])))  # the system prompt's blocks
        mine = {next(k for k in k1 if k not in shared)}  # the conversation's first block of its own
        for i in range(60):  # other prompts straight to a until it has evicted the conversation
            if not mine & snapshot_keys(a):
                break
            direct(a, f"fill{i}", [("user", f"unrelated question number {i} {uuid.uuid4().hex} " * 6)])
        wait_for(lambda: not mine & snapshot_keys(a), "a to evict the conversation")
        wait_for(caught_up, "the gateways to read a's removals")
        assert [routed(gw, turn3) for gw in gws] == [b, b], "both gateways move to the replica still holding it"
        for f in feeds:
            f.index.check_integrity()
            assert f.snapshots >= 2 and f.events >= 2
    finally:
        for s in gws + [a, b]:
            s.stop()
