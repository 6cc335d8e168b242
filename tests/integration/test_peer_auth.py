"""Attacks on what the services trust of their peers, against a real Redis and over real HTTP:

* a KV page planted in the L3 tier (the right Redis key, a tag under another key; or a valid
  value moved to another key) is a miss counted on the LLM's /metrics, and the output equals the
  uncached output;
* an embedding planted in the encoders' Redis tier (a tag under another key, or none) is a miss
  counted on the reader's /metrics (LLM and encoder), and the output equals the by-value output;
* a KV event planted in the stream (a tag under another key, none, or copied from another
  stream) is ignored and counted on the gateway's metrics;
* a ``/v1/generate`` naming an outside URL as its media source is refused (400 naming the
  setting) and that server receives nothing, the service token least of all;
* an encoder answer past the size limit is cut and refused.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid

import httpx
import pytest
import redis
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.metrics import GatewayMetrics
from gateway.routing.kv_feed import KVEventFeed
from gateway.routing.kv_index import KVIndex
from llm_svc.front.kv_publish import KVPublisher
from llm_svc.core.media_fetch import EmbeddingFetcher, MediaSourceRefused, MediaUnavailable
from llm_svc.offload.l3 import _HEADER, DOMAIN
from llm_svc.types.request import EmbeddingRef
from mmserve.testing.fake_services import ServerThread
from shared.embedding_store import entry_key, seal_entry, to_bytes
from shared.kv_events import KVEvent
from shared.peer_auth import TAG_BYTES, PeerKey
from shared.rawwire import RawTensor, pack_raw
from shared.schemas import EncodeResult
from shared.wire import SAFETENSORS_MIME, pack
from tests.integration.test_encoder_cache import encode, metric, png
from tests.integration.test_kv_tiers_service import chat, wait_metric
from tests.integration.test_llm_service import _metric, image_embeds, make_request, post, start_service
from tests.integration.test_media_ref_llm import by_ref

pytestmark = pytest.mark.integration
REDIS = "redis://127.0.0.1:6379/0"
ATTACKER = PeerKey(b"not the services' key, a guess" * 2)
FAILURES = "mmserve_peer_auth_failures_total"


def new_key() -> str:
    return secrets.token_hex(32)


@pytest.fixture
def r():
    c = redis.Redis.from_url(REDIS)
    yield c
    c.close()


# ------------------------------------------------------------------ KV pages (L3)


def forged_page(key: bytes, value: bytes) -> bytes:
    """The value's header with a zeroed payload, tagged under a key the attacker has."""
    header = value[:_HEADER.size]
    zeros = bytes(len(value) - _HEADER.size - TAG_BYTES)
    return header + ATTACKER.tag(DOMAIN, key.decode(), header, zeros) + zeros


def test_a_planted_kv_page_is_a_counted_miss_and_the_output_is_the_uncached_one(mimo_bundle, r):
    kw = dict(kv_l3_url=REDIS, kv_l3_ttl_s=600, kv_l3_page_tokens=32, peer_key=new_key())
    before = set(r.scan_iter(match="mmkv:*", count=1000))
    req = chat("p1", [("user", f"tell me about planted pages {uuid.uuid4().hex}")])
    with start_service(mimo_bundle, "swa", **kw) as a:
        ref = post(a, req, {}).json()  # nothing cached anywhere: the uncached output
        assert ref["cached_tokens"] == 0 and ref["prompt_tokens"] >= 64
        assert wait_metric(a, "mmserve_llm_kv_l3_events", 'event="pages_written"', 2) >= 2
        time.sleep(0.3)  # the writes are asynchronous: let them land
    written = sorted(set(r.scan_iter(match="mmkv:*", count=1000)) - before)
    try:
        assert len(written) >= 2
        good = {k: r.get(k) for k in written}
        with start_service(mimo_bundle, "swa", **kw) as b:  # control: the intact tier serves a fresh replica
            hit = post(b, chat("p2", req_turns(req)), {}).json()
            assert hit["cached_tokens"] > 0 and hit["token_ids"] == ref["token_ids"]
            assert _metric(b, FAILURES, 'source="kv_page"') == 0
        plants = {
            "tagged under another key": {k: forged_page(k, good[k]) for k in written},
            "valid values moved to other keys": {k: good[written[(i + 1) % len(written)]]
                                                 for i, k in enumerate(written)},
        }
        for name, values in plants.items():
            for k, v in values.items():
                r.set(k, v, ex=600)
            with start_service(mimo_bundle, "swa", **kw) as c:
                out = post(c, chat("p3", req_turns(req)), {}).json()
                assert out["token_ids"] == ref["token_ids"], name
                assert out["cached_tokens"] == 0, name
                assert _metric(c, FAILURES, 'source="kv_page"') >= 1, name
                assert _metric(c, "mmserve_llm_kv_l3_events", 'event="hits"') == 0, name
                assert httpx.get(c.url + "/readyz", timeout=5).status_code == 200
    finally:
        for k in written:
            r.delete(k)


def req_turns(req) -> list[tuple[str, str]]:
    return [(m.role, m.content[0].text) for m in req.messages[1:]]


def test_a_planted_page_leaves_the_engine_consistent(mimo16):
    """The same attack on an in-process engine, whose KV manager is reachable: the forged page is
    a miss counted as an auth failure, the tokens are the uncached ones, and the scheduler's
    books balance after."""
    from llm_svc.offload.l3 import chain_hashes, fingerprint
    from llm_svc.types.request import PreparedRequest
    from shared.schemas import SamplingParams
    from tests.integration.test_kv_tiers import PAGE_TOKENS, drop_keys, flush_l3, make_engine, run_to_end, \
        session_turns

    fp = fingerprint({"peer-auth-test": uuid.uuid4().hex})
    lm = mimo16
    _, ids = session_turns(lm, seed=11)
    prompt = ids[:64] + [7]

    def prep(rid):
        return PreparedRequest(request_id=rid, prompt_ids=list(prompt),
                               sampling=SamplingParams(max_tokens=5, ignore_eos=True))

    try:
        want = run_to_end(make_engine(lm, cache=False), [prep("r")])["r"].tokens
        writer = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
        run_to_end(writer, [prep("w")])
        flush_l3(writer)
        store = writer.engine.tiers.l3
        key = store.page_key(chain_hashes(prompt[:64], PAGE_TOKENS), 2)
        c = redis.Redis.from_url(REDIS)
        c.set(key, forged_page(key.encode(), c.get(key)), ex=600)
        c.close()
        fresh = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
        out = run_to_end(fresh, [prep("x")])["x"]
        st = fresh.engine.stats()
        assert out.tokens == want and out.outs[-1].cached_tokens == 0
        assert st["l3_auth_failures"] == 1 and st["l3_hits"] == 0
        fresh.engine.scheduler.check_integrity()
    finally:
        drop_keys(fp)


# ------------------------------------------------------------------ embeddings


def serve(app: FastAPI) -> ServerThread:
    srv = ServerThread(app).start()
    srv.app = app
    return srv


def recording_encoder(store: dict) -> FastAPI:
    """An encoder's GET /v1/embeddings/{key} over ``store`` (key -> tensor) that records every
    request's path and headers in ``app.state.seen``."""
    app = FastAPI()
    app.state.seen = []

    @app.middleware("http")
    async def record(request: Request, call_next):
        app.state.seen.append((request.url.path, dict(request.headers)))
        return await call_next(request)

    @app.get("/v1/embeddings/{key:path}")
    async def embeddings(key: str) -> Response:
        t = store.get(key)
        if t is None:
            return JSONResponse({"error": {"message": "no such key"}}, status_code=404)
        res = EncodeResult(modality="image", content_hash="0" * 16, model="enc", num_tokens=t.shape[0],
                           hidden_size=t.shape[1], cached=True, key=key)
        raw = RawTensor("F32", tuple(t.shape), t.contiguous().numpy().tobytes())
        return Response(pack_raw({"embeds": raw}, res), media_type="application/octet-stream")

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(status_code=200)

    return app


KEY = "enc-model:image:0123456789abcdef:" + "ef" * 32


def test_a_planted_embedding_is_a_counted_miss_and_the_output_is_the_by_value_one(mimo_bundle, r):
    emb = image_embeds(mimo_bundle, seed=3).contiguous()
    prefix = f"mmserve:test:peer:{uuid.uuid4().hex[:8]}:"
    peer_key = new_key()
    enc = serve(recording_encoder({KEY: emb}))
    try:
        port = enc.url.rsplit(":", 1)[1]
        kw = dict(media_redis_url=REDIS, media_redis_prefix=prefix, peer_key=peer_key,
                  media_fetch_allow=[f"127.0.0.1:{port}"])
        with start_service(mimo_bundle, "hf", **kw) as svc:
            value = post(svc, by_ref(make_request("describe", max_tokens=6, rid="v"), None, key=KEY), {"mm.0": emb})
            assert value.status_code == 200, value.text
            zeros = torch.zeros_like(emb)
            plants = {
                "tagged under another key": seal_entry(ATTACKER, KEY, to_bytes(KEY, zeros)),
                "no tag (the format before tags)": to_bytes(KEY, zeros),
                "the services' tag of another media key": seal_entry(PeerKey(peer_key.encode()), "other",
                                                                     to_bytes(KEY, zeros)),
            }
            for i, (name, planted) in enumerate(plants.items(), 1):
                r.set(entry_key(prefix, KEY), planted, ex=60)
                gets = len(enc.app.state.seen)
                out = post(svc, by_ref(make_request("describe", max_tokens=6, rid=f"a{i}"), enc.url, key=KEY), {})
                assert out.status_code == 200, (name, out.text)
                assert out.json()["token_ids"] == value.json()["token_ids"], name
                assert _metric(svc, FAILURES, 'source="embedding"') == i, name
                assert len(enc.app.state.seen) == gets + 1, name  # the encoder served it instead
            # control: a value tagged under the services' key is used (the encoder is not asked)
            r.set(entry_key(prefix, KEY), seal_entry(PeerKey(peer_key.encode()), KEY, to_bytes(KEY, emb)), ex=60)
            gets = len(enc.app.state.seen)
            ok = post(svc, by_ref(make_request("describe", max_tokens=6, rid="ok"), enc.url, key=KEY), {})
            assert ok.json()["token_ids"] == value.json()["token_ids"]
            assert len(enc.app.state.seen) == gets
            assert _metric(svc, "mmserve_llm_media_fetch_source_total", 'source="redis"') == 1
    finally:
        enc.stop()
        r.delete(entry_key(prefix, KEY))


def test_a_planted_embedding_in_the_encoders_tier_is_recomputed(mimo_bundle, r):
    from encoder_svc.app import create_app as encoder_app
    from encoder_svc.server import serve_in_thread
    from shared.settings import EncoderSettings

    prefix = f"mmserve:test:peer:{uuid.uuid4().hex[:8]}:"
    s = EncoderSettings(model_dir=str(mimo_bundle), redis_url=REDIS, cache_bytes=0, peer_key=new_key())
    image = png(41)
    try:
        with serve_in_thread(encoder_app(s, redis_prefix=prefix)) as url:
            first, res, _ = encode(url, image)  # computed, stored in Redis with the services' tag
            [stored] = list(r.scan_iter(match=f"{prefix}*"))
            assert metric(url, FAILURES, source="embedding") == 0
            again, _, _ = encode(url, image)  # a Redis hit
            assert torch.equal(again, first)
            r.set(stored, seal_entry(ATTACKER, res.key, to_bytes(res.key, torch.zeros_like(first))), ex=60)
            after, _, _ = encode(url, image)
            assert torch.equal(after, first)  # recomputed, not the planted zeros
            assert metric(url, FAILURES, source="embedding") == 1
            assert metric(url, "encoder_cache_lookups_total", tier="redis", result="miss") >= 2
    finally:
        for k in r.scan_iter(match=f"{prefix}*"):
            r.delete(k)


# ------------------------------------------------------------------ KV events


def test_a_planted_kv_event_is_ignored_and_counted(r):
    stream = f"mmserve:test:kv-events:{uuid.uuid4().hex}"
    key = PeerKey(new_key().encode())

    async def go():
        pub = KVPublisher(REDIS, stream, maxlen=1000, peer=key)
        index = KVIndex()
        metrics = GatewayMetrics()
        async with httpx.AsyncClient() as http:
            feed = KVEventFeed(REDIS, stream, index, http, lambda: {pub.instance: "http://127.0.0.1:9"}, peer=key)
            metrics.watch_kv_feed(feed)
            task = asyncio.create_task(feed.run())
            try:
                await until(lambda: feed.connected)
                pub.start()
                pub.apply([1, 2], [])
                await until(lambda: index.seq(pub.instance) == 1)
                # what an attacker with write access to Redis appends: the next seq of the real
                # instance, claiming it holds 999 and dropped 1
                forged = KVEvent(pub.instance, 2, stored=[999], removed=[1])
                elsewhere = f"{stream}:other"
                for fields in (forged.fields(stream, ATTACKER),                     # another key
                               {k: v for k, v in forged.fields(stream, key).items() if k != "m"},  # no tag
                               forged.fields(elsewhere, key)):                      # another stream's
                    r.xadd(stream, fields)
                await until(lambda: feed.auth_failures == 3)
                pub.apply([3], [])  # the genuine seq 2 still applies: the forgeries took no seq
                await until(lambda: index.seq(pub.instance) == 2)
                assert not index.holds(pub.instance, 999) and index.holds(pub.instance, 1)
                assert {k for k in (1, 2, 3, 999) if index.holds(pub.instance, k)} == pub.keys == {1, 2, 3}
                assert feed.events == 2
                index.check_integrity()
                return metrics.render().decode()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await pub.close()

    try:
        text = asyncio.run(go())
    finally:
        r.delete(stream)
    assert f'{FAILURES}{{source="kv_event"}} 3.0' in text


async def until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ media sources


@pytest.mark.parametrize("backend", ["hf", "swa"])  # fetched by the front / on the engine core's demand
def test_generate_naming_an_outside_source_is_refused_and_it_hears_nothing(mimo_bundle, backend):
    emb = image_embeds(mimo_bundle, seed=4).contiguous()
    token = new_key()
    enc = serve(recording_encoder({KEY: emb}))
    outside = serve(recording_encoder({KEY: emb}))  # serves the same key: a lure
    try:
        port = enc.url.rsplit(":", 1)[1]
        with start_service(mimo_bundle, backend, service_token=token, media_fetch_allow=[f"127.0.0.1:{port}"]) as svc:
            def post(svc, req, tensors, headers):  # as the gateway sends it, with the token
                return httpx.post(svc.url + "/v1/generate", content=pack(tensors, req), timeout=120,
                                  headers={"content-type": SAFETENSORS_MIME, **headers})

            auth = {"x-mmserve-service-token": token}
            for stream in (False, True):
                req = by_ref(make_request("describe", max_tokens=4, rid=f"o{stream}"), outside.url, key=KEY)
                req.stream = stream
                out = post(svc, req, {}, headers=auth)
                assert out.status_code == 400, out.text
                err = out.json()["error"]
                assert err["code"] == "media_source_not_allowed", err
                assert "MMSERVE_LLM_MEDIA_FETCH_ALLOW" in err["message"] and outside.url not in err["message"]
            # an outside source beside an allowed one: skipped, the allowed encoder serves
            req = by_ref(make_request("describe", max_tokens=4, rid="both"), outside.url, key=KEY)
            req.messages[1].content[1].sources = [outside.url, enc.url]
            ok = post(svc, req, {}, headers=auth)
            assert ok.status_code == 200, ok.text
            assert outside.app.state.seen == []  # never contacted, so never given the token
            [(path, headers)] = enc.app.state.seen
            assert headers.get("x-mmserve-service-token") == token and path.startswith("/v1/embeddings/")
            assert httpx.get(svc.url + "/readyz", timeout=5).status_code == 200
    finally:
        enc.stop()
        outside.stop()


def test_the_default_allows_this_machine_only():
    async def go():
        f = EmbeddingFetcher(8, timeout=5)
        try:
            with pytest.raises(MediaSourceRefused, match="MMSERVE_LLM_MEDIA_FETCH_ALLOW"):
                await f.fetch(EmbeddingRef("k:image:s:1", ("http://192.0.2.10:8100",), 2))  # TEST-NET-1
            with pytest.raises(MediaSourceRefused):
                await f.fetch(EmbeddingRef("k:image:s:1", ("http://user:pw@127.0.0.1:9",), 2))
            return f.gets
        finally:
            await f.close()

    assert asyncio.run(go()) == 0


def test_an_answer_past_the_size_limit_is_cut_and_refused():
    hidden, rows = 8, 4
    sent = {"bytes": 0}
    app = recording_encoder({"k:image:s:big": torch.ones(rows * 4096, hidden)})  # a long, honest answer

    @app.get("/endless/v1/embeddings/{key:path}")
    async def endless(key: str) -> StreamingResponse:  # no Content-Length: only the stream can be cut
        async def body():
            chunk = b"\0" * 65536
            for _ in range(16384):  # 1 GiB if nobody stops reading
                sent["bytes"] += len(chunk)
                yield chunk

        return StreamingResponse(body(), media_type="application/octet-stream")

    async def go(url: str):
        f = EmbeddingFetcher(hidden, timeout=30, allow=["127.0.0.1"], max_bytes=64 * 1024)
        try:
            with pytest.raises(MediaUnavailable, match="MMSERVE_LLM_MEDIA_FETCH_MAX_BYTES"):
                await f.fetch(EmbeddingRef("k:image:s:big", (url,), rows * 4096))
            with pytest.raises(MediaUnavailable, match="MMSERVE_LLM_MEDIA_FETCH_MAX_BYTES"):
                await f.fetch(EmbeddingRef("k:image:s:endless", (url + "/endless",), rows))
        finally:
            await f.close()

    with ServerThread(app) as srv:
        asyncio.run(go(srv.url))
    assert sent["bytes"] < 1 << 30  # the endless answer was cut, not read to its end
