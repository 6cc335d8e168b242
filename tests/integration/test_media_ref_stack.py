"""Media by reference through the real stack over HTTP: gateway + encoder + ``swa`` LLM (its
engine core in its own process). The gateway sends keys; the LLM fetches embeddings from the
encoder only for spans its prefix cache misses; outputs equal the by-value path with the prefix
cache off; an evicted embedding is re-sent by value; identical concurrent images encode once;
the gateway process never imports torch."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks._stack_util import scrape, total
from encoder_svc.app import create_app as encoder_app
from encoder_svc.server import serve_in_thread
from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread
from shared.settings import EncoderSettings, GatewaySettings
from tests.conftest import make_png
from tests.integration.test_llm_service import start_service
from tests.sse import sse_events

pytestmark = pytest.mark.integration
MODEL = "mmserve-tiny"


def metric(url: str, name: str, **labels) -> float:
    return total(scrape(url), name, **labels)


def refs(llm: str) -> dict[str, float]:
    return {o: metric(llm, "mmserve_llm_media_refs_total", outcome=o) for o in ("fetched", "skipped", "missed")}


def image(seed: int) -> dict:
    data = base64.b64encode(make_png(seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def chat(url: str, messages: list[dict], stream: bool = False, max_tokens: int = 6) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for ev in sse_events(r):
            text += [c["delta"].get("content") or "" for c in ev["choices"]]
    return "".join(text)


def gateway_settings(enc: str, llm: str, by_ref: bool) -> GatewaySettings:
    return GatewaySettings(model_name=MODEL, encoder_urls=[enc], llm_urls=[llm], health_interval=0, dns_interval=0,
                           media_by_ref=by_ref)


@pytest.fixture(scope="module")
def stack(mimo_bundle):
    enc_settings = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=1 << 22)
    enc_app = encoder_app(enc_settings)
    with serve_in_thread(enc_app) as enc, start_service(mimo_bundle, "swa") as cached, \
            start_service(mimo_bundle, "swa", enable_prefix_cache=False) as plain:
        ref_gw = ServerThread(gateway_app(gateway_settings(enc, cached.url, True))).start()
        val_gw = ServerThread(gateway_app(gateway_settings(enc, plain.url, False))).start()
        deadline = time.monotonic() + 240
        for u in (cached.url, plain.url):
            while httpx.get(u + "/readyz", timeout=5).status_code != 200:
                assert time.monotonic() < deadline, "LLM not ready"
                time.sleep(0.2)
        yield {"enc": enc, "enc_app": enc_app, "llm": cached.url, "plain": plain.url, "ref": ref_gw.url,
               "value": val_gw.url}
        ref_gw.stop()
        val_gw.stop()
        enc_app.state.service.check_integrity()


def test_turn_two_fetches_nothing_for_the_image_it_re_sends(stack):
    llm = stack["llm"]
    turn1 = [{"role": "user", "content": [image(1), {"type": "text", "text": "what is in this picture?"}]}]
    before = refs(llm)
    bytes0 = metric(stack["ref"], "mmserve_gateway_llm_body_bytes_total")
    a1 = chat(stack["ref"], turn1)
    after1 = refs(llm)
    assert after1["fetched"] == before["fetched"] + 1  # turn 1: the image is past any cached prefix
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "and the colours?"}]
    a2 = chat(stack["ref"], turn2, stream=True)
    after2 = refs(llm)
    assert after2["fetched"] == after1["fetched"] and after2["skipped"] == after1["skipped"] + 1
    assert after2["missed"] == before["missed"]
    ref_bytes = metric(stack["ref"], "mmserve_gateway_llm_body_bytes_total") - bytes0
    # the by-value path with the prefix cache off gives the same tokens
    vbytes0 = metric(stack["value"], "mmserve_gateway_llm_body_bytes_total")
    assert chat(stack["value"], turn1) == a1
    assert chat(stack["value"], turn2, stream=True) == a2
    val_bytes = metric(stack["value"], "mmserve_gateway_llm_body_bytes_total") - vbytes0
    assert ref_bytes * 4 < val_bytes  # keys instead of [16, hidden] float32 tensors
    assert metric(stack["ref"], "mmserve_gateway_media_sent_total", how="ref") >= 2


@pytest.mark.parametrize("stream", [False, True])
def test_an_evicted_embedding_is_re_sent_by_value(stack, stream):
    llm, gw = stack["llm"], stack["ref"]
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"fresh conversation {stream}"}, image(2)]}]
    cache = stack["enc_app"].state.service.cache
    cache.tiers[0].clear()  # an earlier by-value comparison may have cached image 2
    resends, missed = metric(gw, "mmserve_gateway_media_resends_total"), refs(llm)["missed"]

    def evict_then_send():
        # the encode keeps it; clearing the cache before the LLM fetches it makes the fetch miss
        orig = cache.put

        async def put_and_forget(key, modality, value):
            await orig(key, modality, value)
            cache.tiers[0].clear()
            return True

        cache.put = put_and_forget
        try:
            return chat(gw, msgs, stream=stream)
        finally:
            cache.put = orig

    text = evict_then_send()
    assert metric(gw, "mmserve_gateway_media_resends_total") == resends + 1
    assert refs(llm)["missed"] == missed + 1
    assert text == chat(stack["value"], msgs, stream=stream)  # same answer as by value
    assert httpx.get(llm + "/readyz", timeout=5).status_code == 200


def test_concurrent_identical_images_encode_once(stack):
    enc = stack["enc"]
    forwards = metric(enc, "encoder_forward_passes_total")
    msgs = [{"role": "user", "content": [image(3), {"type": "text", "text": "describe"}]}]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: chat(stack["ref"], msgs, max_tokens=3), range(4)))
    assert len(set(texts)) == 1
    assert metric(enc, "encoder_forward_passes_total") == forwards + 1
    stack["enc_app"].state.service.check_integrity()


_GATEWAY_SCRIPT = """
import json, sys
import httpx
from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread
from shared.settings import GatewaySettings

enc, llm, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
s = GatewaySettings(model_name=body["model"], encoder_urls=[enc], llm_urls=[llm], health_interval=0, dns_interval=0)
with ServerThread(create_app(s)) as gw:
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=180)
print(json.dumps({"status": r.status_code, "text": r.text[:300],
                  "heavy": sorted(m for m in ("torch", "safetensors", "numpy") if m in sys.modules)}))
"""


def test_the_gateway_process_never_imports_torch(stack):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": [image(4), {"type": "text", "text": "hi"}]}]}
    out = subprocess.run([sys.executable, "-c", _GATEWAY_SCRIPT, stack["enc"], stack["llm"], json.dumps(body)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == 200, result
    assert result["heavy"] == [], result


def test_encoder_answers_by_reference_only_when_it_keeps_the_embeddings(mimo_bundle, stack):
    png = make_png(seed=5)
    q = {"modality": "image", "by_ref": "true"}
    r = httpx.post(f"{stack['enc']}/v1/encode", params=q, content=png, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    res = r.json()
    assert res["by_ref"] and res["num_tokens"] >= 1 and res["key"] == r.headers["x-mmserve-cache-key"]
    g = httpx.get(f"{stack['enc']}/v1/embeddings/{res['key']}", timeout=10)
    assert g.status_code == 200 and g.headers["content-type"] == "application/x-safetensors"
    # an encoder without a cache cannot keep them: it answers by value although asked by reference
    with serve_in_thread(encoder_app(EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0))) as bare:
        r = httpx.post(f"{bare}/v1/encode", params=q, content=png, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-safetensors"
