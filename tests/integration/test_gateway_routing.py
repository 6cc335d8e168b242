"""Encoder ring routing, failover and health; LLM replica failover and policies."""

import base64
import json
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.routing.encoder_ring import EncoderRing
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app, free_port_url
from shared.hashing import content_hash
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

MODEL = "m"


def audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode()}}


def chat(*parts, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": list(parts)}], **kw}


def echo(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return json.loads(r.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def servers():
    encs = [ServerThread(fake_encoder_app(f"e{i}")).start() for i in range(2)]
    llms = [ServerThread(fake_llm_app(f"l{i}")).start() for i in range(2)]
    yield encs, llms
    for s in encs + llms:
        s.stop()


def gateway(encoder_urls, llm_urls, **kw) -> ServerThread:
    settings = GatewaySettings(model_name=MODEL, encoder_urls=encoder_urls, llm_urls=llm_urls,
                               dns_interval=0, connect_timeout=2, **{"health_interval": 0, **kw})
    return ServerThread(create_app(settings)).start()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def calls(server: ServerThread) -> list:
    return server.server.config.app.state.calls


def test_same_bytes_same_replica_and_spread(servers):
    encs, llms = servers
    urls = [e.url for e in encs]
    ring = EncoderRing(urls)
    with gateway(urls, [llms[0].url]) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        blobs = [f"clip-{i}".encode() * 3 for i in range(12)]
        for _ in range(2):
            for b in blobs:
                echo(c.post("/v1/chat/completions", json=chat(audio(b))))
        owners = {e.url: [h for _, h, _ in calls(e)] for e in encs}
        for b in blobs:
            h = content_hash(b)
            owner = ring.owner(h)
            assert owners[owner].count(h) == 2, "both requests for the same bytes go to its ring owner"
            assert all(h not in hs for url, hs in owners.items() if url != owner)
        assert all(owners.values()), "keys spread over both replicas"


def test_dead_first_replica_retries_on_next_node(servers):
    encs, llms = servers
    dead = free_port_url()
    urls = [encs[0].url, dead]
    ring = EncoderRing(urls)
    blob = next(b for b in (f"x{i}".encode() for i in range(1000)) if ring.owner(content_hash(b)) == dead)
    before = len(calls(encs[0]))
    with gateway(urls, [llms[0].url]) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        part = echo(c.post("/v1/chat/completions", json=chat(audio(blob))))["messages"][0]["parts"][0]
        assert part["fill"] == len(blob)
        assert calls(encs[0])[before:] == [("audio", content_hash(blob), len(blob))]
        metrics = c.get("/metrics").text
        assert "mmserve_gateway_encoder_failovers_total 1.0" in metrics


def test_all_encoders_failing_is_502(servers):
    encs, llms = servers
    with gateway([free_port_url(), free_port_url()], [llms[0].url]) as gw, \
            httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=chat(audio(b"abc")))
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["type"] == "upstream_error" and "messages[0].content[0]" in err["message"]
        assert "2 encoder replica(s)" in err["message"]
        assert c.get("/readyz").status_code == 503


@pytest.mark.parametrize("status,fails_over", [(503, True), (500, False), (504, False)])
def test_encoder_fails_over_only_on_503(servers, status, fails_over):
    """503 (not serving) is tried on the next replica; a 500 or a 504 is answered at once:
    retrying failed or timed-out work would add load to an overloaded stack."""
    encs, llms = servers
    urls = [e.url for e in encs]
    ring = EncoderRing(urls)
    blob = b"fail over me"
    owner = next(e for e in encs if e.url == ring.owner(content_hash(blob)))
    other = next(e for e in encs if e is not owner)
    owner.server.config.app.state.fail_5xx = True
    owner.server.config.app.state.fail_status = status
    try:
        with gateway(urls, [llms[0].url]) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
            n_other = len(calls(other))
            r = c.post("/v1/chat/completions", json=chat(audio(blob)))
            if fails_over:
                echo(r)
                assert calls(other)[n_other:] == [("audio", content_hash(blob), len(blob))]
            else:
                assert r.status_code == (504 if status == 504 else 502), r.text
                assert "boom" in r.json()["error"]["message"]
                assert calls(other)[n_other:] == []
    finally:
        owner.server.config.app.state.fail_5xx = False
        owner.server.config.app.state.fail_status = 500


def test_health_checker_removes_and_readds_unready_encoder(servers):
    encs, llms = servers
    urls = [e.url for e in encs]
    ring = EncoderRing(urls)
    blob = next(b for b in (f"h{i}".encode() for i in range(1000)) if ring.owner(content_hash(b)) == urls[1])
    app1 = encs[1].server.config.app
    app1.state.ready = False
    try:
        with gateway(urls, [llms[0].url], health_interval=0.1) as gw, \
                httpx.Client(base_url=gw.url, timeout=30) as c:
            pool = gw.server.config.app.state.gateway.encoder_pool
            wait_for(lambda: pool.healthy() == urls[:1])
            n0, n1 = len(calls(encs[0])), len(calls(encs[1]))
            echo(c.post("/v1/chat/completions", json=chat(audio(blob))))
            assert len(calls(encs[0])) == n0 + 1 and len(calls(encs[1])) == n1
            app1.state.ready = True
            wait_for(lambda: pool.healthy() == urls)
            echo(c.post("/v1/chat/completions", json=chat(audio(blob))))
            assert len(calls(encs[1])) == n1 + 1
    finally:
        app1.state.ready = True


def test_dead_llm_replica_fails_over(servers):
    encs, llms = servers
    with gateway([encs[0].url], [free_port_url(), llms[1].url], llm_routing="round_robin") as gw, \
            httpx.Client(base_url=gw.url, timeout=30) as c:
        replicas = {echo(c.post("/v1/chat/completions", json=chat({"type": "text", "text": f"q{i}"})))["replica"]
                    for i in range(3)}
        assert replicas == {"l1"}


def test_cache_aware_routing_keeps_a_conversation_on_one_replica(servers):
    encs, llms = servers
    system = {"role": "system", "content": "You are a very careful assistant. " * 8}
    with gateway([encs[0].url], [l.url for l in llms], llm_routing="cache_aware") as gw, \
            httpx.Client(base_url=gw.url, timeout=30) as c:
        seen = set()
        for i in range(4):
            body = {"model": MODEL, "messages": [system, {"role": "user", "content": f"turn {i}"}]}
            seen.add(echo(c.post("/v1/chat/completions", json=body))["replica"])
        assert len(seen) == 1
    with gateway([encs[0].url], [l.url for l in llms], llm_routing="round_robin") as gw, \
            httpx.Client(base_url=gw.url, timeout=30) as c:
        seen = set()
        for i in range(4):
            body = {"model": MODEL, "messages": [system, {"role": "user", "content": f"turn {i}"}]}
            seen.add(echo(c.post("/v1/chat/completions", json=body))["replica"])
        assert seen == {"l0", "l1"}


def test_identical_media_encoded_once_per_request(servers):
    encs, llms = servers
    blob = b"the same clip twice"
    with gateway([encs[0].url], [llms[0].url]) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        n = len(calls(encs[0]))
        parts = echo(c.post("/v1/chat/completions", json=chat(audio(blob), audio(blob))))["messages"][0]["parts"]
        assert [(p["index"], p["fill"]) for p in parts] == [(0, len(blob)), (1, len(blob))]
        assert len(calls(encs[0])) == n + 1


def test_request_timeout_is_504(servers):
    encs, llms = servers
    with gateway([encs[0].url], [llms[0].url], request_timeout=0.5) as gw, \
            httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=chat({"type": "text", "text": "SLOW"}))
        assert r.status_code == 504 and "timed out after 0.5s" in r.json()["error"]["message"]


def test_llm_5xx_fails_over_and_all_5xx_is_502(servers):
    encs, llms = servers
    app0 = llms[0].server.config.app
    app0.state.fail_5xx = True
    try:
        with gateway([encs[0].url], [l.url for l in llms], llm_routing="round_robin") as gw, \
                httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(2):
                assert echo(c.post("/v1/chat/completions", json=chat({"type": "text", "text": f"{i}"})))["replica"] == "l1"
        with gateway([encs[0].url], [llms[0].url]) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json=chat({"type": "text", "text": "x"}, stream=True))
            assert r.status_code == 502 and "engine down" in r.json()["error"]["message"]
    finally:
        app0.state.fail_5xx = False
