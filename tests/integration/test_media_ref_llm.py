"""The LLM service with media by reference, both backends, over real HTTP: the embeddings are
fetched from an encoder by key (``hf`` fetches every item, ``swa`` only what its prefix cache
misses) and give the same tokens as by value; a key no encoder serves is a 409
``media_unavailable`` (streamed or not) and the service keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from mmserve.testing.fake_services import ServerThread as Thread
from mmserve.testing.fake_services import fake_encoder_app
from shared.rawwire import RawTensor
from shared.schemas import PromptMedia
from tests.integration.test_llm_service import BACKENDS, image_embeds, make_request, post, start_service
from tests.integration.test_media_ref_stack import metric

pytestmark = pytest.mark.integration
KEY = "enc-model:image:0123456789abcdef:" + "ab" * 32


def by_ref(req, url: str | None, key: str = KEY):
    """The request's image keyed by ``key``; by reference to ``url`` (None: by value)."""
    media = req.messages[1].content[1]
    assert isinstance(media, PromptMedia)
    req.messages[1].content[1] = media.model_copy(update={"key": key, "sources": [url] if url else []})
    return req


@pytest.fixture(scope="module")
def encoder(mimo_bundle):
    emb = image_embeds(mimo_bundle).contiguous()
    app = fake_encoder_app("enc", hidden=emb.shape[1])
    app.state.store[KEY] = RawTensor("F32", tuple(emb.shape), emb.numpy().tobytes())
    with Thread(app) as srv:
        srv.app, srv.emb = app, emb
        yield srv


@pytest.mark.parametrize("backend", BACKENDS)
def test_by_reference_matches_by_value_and_a_missing_key_is_409(backend, mimo_bundle, encoder):
    with start_service(mimo_bundle, backend) as svc:
        value = post(svc, by_ref(make_request("describe", max_tokens=6, rid="v"), None), {"mm.0": encoder.emb})
        assert value.status_code == 200, value.text
        gets = len(encoder.app.state.gets)
        ref = post(svc, by_ref(make_request("describe", max_tokens=6, rid="r"), encoder.url), {})
        assert ref.status_code == 200, ref.text
        assert ref.json()["token_ids"] == value.json()["token_ids"]
        fetched = len(encoder.app.state.gets) - gets
        # swa: the same prompt by value just ran, so its prefix cache covers the image
        assert fetched == (1 if backend == "hf" else 0)
        outcome = "fetched" if backend == "hf" else "skipped"
        assert metric(svc.url, "mmserve_llm_media_refs_total", outcome=outcome) == 1

        for stream in (False, True):
            req = by_ref(make_request(f"other text {stream}", max_tokens=4, rid=f"m{stream}"), encoder.url,
                         key=KEY.replace("ab", "cd"))
            req.stream = stream
            r = post(svc, req, {})
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "media_unavailable" and "HTTP 404" in err["message"], err
        assert metric(svc.url, "mmserve_llm_media_refs_total", outcome="missed") == 2

        req = by_ref(make_request("a fresh prompt", max_tokens=4, rid="s"), encoder.url)
        req.stream = True
        with httpx.stream("POST", svc.url + "/v1/generate", content=_pack(req), timeout=120) as r:
            assert r.status_code == 200
            lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
        assert lines[-1]["finish_reason"] == "length" and lines[-1]["completion_tokens"] == 4
        assert sum(len(x.get("token_ids", [])) for x in lines) == 4
        assert httpx.get(svc.url + "/readyz", timeout=5).status_code == 200


def _pack(req) -> bytes:
    from shared.wire import pack

    return pack({}, req)
