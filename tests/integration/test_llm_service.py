"""The LLM service over real HTTP on loopback (uvicorn in a thread), checked against transformers."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from shared.schemas import GenerateRequest, PromptMedia, PromptMessage, PromptText, SamplingParams
from shared.settings import LLMSettings
from shared.wire import SAFETENSORS_MIME, pack

pytestmark = pytest.mark.integration

BACKENDS = ["hf", "swa"]


class ServerThread:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("LLM service did not become ready")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_service(model_dir, backend: str, **kw) -> ServerThread:
    from llm_svc.front.app import create_app

    settings = LLMSettings(model_dir=str(model_dir), backend=backend, max_model_len=512,
                           kv_bytes=32 * 1024 * 1024, **kw)
    svc = ServerThread(create_app(settings))
    svc.backend = backend
    return svc


def image_embeds(bundle, seed: int = 0) -> torch.Tensor:
    """The real vision tower + projector of the bundle on a random image: [16, hidden]."""
    from transformers import SiglipVisionModel

    from shared.projector import PoolProjector

    vision = SiglipVisionModel.from_pretrained(bundle / "vision").eval()
    proj = PoolProjector.load(bundle / "vision")
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return proj(vision(pixel_values=pixels).last_hidden_state)[0]


def make_request(text: str, n_media: int = 1, num_tokens: int = 16, rid: str = "r1", **sampling) -> GenerateRequest:
    parts = [PromptText(text=text)]
    parts += [PromptMedia(modality="image", index=i, content_hash=f"h{i}", num_tokens=num_tokens) for i in range(n_media)]
    return GenerateRequest(
        request_id=rid,
        messages=[PromptMessage(role="system", content=[PromptText(text="you are a helpful assistant")]),
                  PromptMessage(role="user", content=parts)],
        sampling=SamplingParams(**sampling),
    )


def post(svc: ServerThread, req: GenerateRequest, tensors: dict, **kw) -> httpx.Response:
    return httpx.post(svc.url + "/v1/generate", content=pack(tensors, req),
                      headers={"content-type": SAFETENSORS_MIME}, timeout=120, **kw)


def _reference_embeds(model, tok, req, emb) -> tuple[list[int], torch.Tensor]:
    """The prompt as transformers sees it: chat template, image pad expanded, rows replaced."""
    msgs = [{"role": m.role, "content": [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"}
                                         for p in m.content]} for m in req.messages]
    ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    k = ids.index(pad)
    ids = ids[:k] + [pad] * emb.shape[0] + ids[k + 1 :]
    with torch.no_grad():
        x = model.get_input_embeddings()(torch.tensor([ids]))
        x[0, k : k + emb.shape[0]] = emb
    return ids, x


def reference_generate(bundle, req: GenerateRequest, emb: torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on the same prompt: chat template, pad expanded, rows replaced."""
    from transformers import AutoTokenizer, MiMoV2FlashForCausalLM

    tok = AutoTokenizer.from_pretrained(bundle)
    model = MiMoV2FlashForCausalLM.from_pretrained(bundle, attn_implementation="eager").eval()
    ids, x = _reference_embeds(model, tok, req, emb)
    with torch.no_grad():
        out = model.generate(inputs_embeds=x, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0].tolist()


@pytest.fixture(scope="module", params=BACKENDS)
def mimo_service(request, mimo_bundle):
    with start_service(mimo_bundle, request.param) as svc:
        yield svc


@pytest.fixture(scope="module")
def mimo_image(mimo_bundle) -> torch.Tensor:
    return image_embeds(mimo_bundle)


def test_greedy_matches_transformers_generate(mimo_service, mimo_bundle, mimo_image):
    req = make_request("what is in this picture? describe it", max_tokens=24)
    r = post(mimo_service, req, {"mm.0": mimo_image})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = reference_generate(mimo_bundle, req, mimo_image, 24)
    assert body["token_ids"] == expected
    assert body["completion_tokens"] == len(expected)
    assert body["finish_reason"] == ("stop" if len(expected) < 24 else "length")
    assert body["prompt_tokens"] > 16


def test_stream_concatenation_equals_non_stream(mimo_service, mimo_bundle, mimo_image):
    from transformers import AutoTokenizer

    req = make_request("hello, tell me about the cat", max_tokens=40, ignore_eos=True)
    full = post(mimo_service, req, {"mm.0": mimo_image}).json()
    req.stream, req.request_id = True, "r-stream"
    with httpx.stream("POST", mimo_service.url + "/v1/generate", content=pack({"mm.0": mimo_image}, req),
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["completion_tokens"] == 40
    assert all(c.get("finish_reason") is None for c in chunks[:-1])
    tok = AutoTokenizer.from_pretrained(mimo_bundle)
    assert full["text"] == tok.decode(full["token_ids"], skip_special_tokens=True)


def test_stop_string_cuts_text_and_is_not_emitted(mimo_service, mimo_image):
    req = make_request("say something", max_tokens=40, ignore_eos=True, rid="r-free")
    free = post(mimo_service, req, {"mm.0": mimo_image}).json()["text"]
    assert len(free) > 12
    stop = free[8:11]
    cut = free.index(stop)
    req2 = make_request("say something", max_tokens=40, ignore_eos=True, stop=[stop], rid="r-stop")
    body = post(mimo_service, req2, {"mm.0": mimo_image}).json()
    assert body["finish_reason"] == "stop"
    assert body["text"] == free[:cut]
    req2.stream, req2.request_id = True, "r-stop-stream"
    with httpx.stream("POST", mimo_service.url + "/v1/generate", content=pack({"mm.0": mimo_image}, req2),
                      timeout=120) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(c["text"] for c in chunks) == free[:cut]
    assert chunks[-1]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(mimo_service, mimo_image):
    a = post(mimo_service, make_request("hi", max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                                        ignore_eos=True, rid="s1"), {"mm.0": mimo_image}).json()
    b = post(mimo_service, make_request("hi", max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                                        ignore_eos=True, rid="s2"), {"mm.0": mimo_image}).json()
    g = post(mimo_service, make_request("hi", max_tokens=16, ignore_eos=True, rid="s3"), {"mm.0": mimo_image}).json()
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != g["token_ids"]


@pytest.mark.parametrize(
    "case",
    ["wrong_rows", "wrong_hidden", "too_long", "malformed", "missing_tensor", "extra_tensor", "bad_stop_id"],
)
def test_bad_input_gives_400_with_message(mimo_service, mimo_image, case):
    req, tensors = make_request("describe", max_tokens=8), {"mm.0": mimo_image}
    if case == "wrong_rows":
        tensors = {"mm.0": mimo_image[:10]}
    elif case == "wrong_hidden":
        tensors = {"mm.0": torch.zeros(16, 32)}
    elif case == "too_long":
        req = make_request("describe " * 600, max_tokens=8)
    elif case == "missing_tensor":
        tensors = {}
    elif case == "extra_tensor":
        tensors = {"mm.0": mimo_image, "mm.5": mimo_image.clone()}
    elif case == "bad_stop_id":
        req = make_request("describe", max_tokens=8, stop_token_ids=[10**6])
    if case == "malformed":
        r = httpx.post(mimo_service.url + "/v1/generate", content=b"{not safetensors", timeout=30)
    else:
        r = post(mimo_service, req, tensors)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert len(err["message"]) > 10
    # the service stays healthy for the next request
    ok = post(mimo_service, make_request("describe", max_tokens=2, rid=f"after-{case}"), {"mm.0": mimo_image})
    assert ok.status_code == 200


def _metric(svc: ServerThread, name: str, label: str = "") -> float:
    text = httpx.get(svc.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_aborts_request(mimo_service, mimo_image):
    before = _metric(mimo_service, "mmserve_llm_requests_total", 'finish_reason="abort"')
    before_tokens = _metric(mimo_service, "mmserve_llm_generation_tokens_total")
    req = make_request("go on forever", max_tokens=400, ignore_eos=True, rid="r-gone")
    req.stream = True
    with httpx.stream("POST", mimo_service.url + "/v1/generate", content=pack({"mm.0": mimo_image}, req),
                      timeout=120) as r:
        first = next(r.iter_lines())
        assert json.loads(first)["request_id"] == "r-gone"
    deadline = time.monotonic() + 60
    while _metric(mimo_service, "mmserve_llm_requests_total", 'finish_reason="abort"') <= before:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    # the stream really ended with finish_reason=abort (not length): its tokens were cut short
    assert _metric(mimo_service, "mmserve_llm_generation_tokens_total") < 400 + before_tokens
    body = post(mimo_service, make_request("next", max_tokens=3, rid="r-gone"), {"mm.0": mimo_image}).json()
    assert body["completion_tokens"] >= 1  # the request id is free again


def test_health_ready_and_metrics(mimo_service):
    assert httpx.get(mimo_service.url + "/healthz").json()["status"] == "ok"
    assert httpx.get(mimo_service.url + "/readyz").status_code == 200
    text = httpx.get(mimo_service.url + "/metrics").text
    for name in ("mmserve_llm_requests_total", "mmserve_llm_generation_tokens_total",
                 "mmserve_llm_time_to_first_token_seconds_bucket", "mmserve_llm_kv_pool_usage",
                 "mmserve_llm_prefix_hit_tokens_total", "mmserve_llm_waiting_requests"):
        assert name in text
    if mimo_service.backend == "swa":  # finished requests stay in the prefix cache: the full pool is in use
        post(mimo_service, make_request("fill the cache", max_tokens=2, rid="m1"), {"mm.0": torch.zeros(16, 64)})
        assert _metric(mimo_service, "mmserve_llm_kv_pool_usage", 'pool="full"') > 0


@pytest.fixture(scope="module", params=BACKENDS)
def gemma_service(request, gemma3_bundle):
    with start_service(gemma3_bundle, request.param) as svc:
        yield svc


def test_gemma3_image_matches_generate_with_pixels(gemma_service, gemma3_bundle):
    """Embeddings from Gemma's own tower give the tokens of generate(input_ids, pixel_values,
    token_type_ids): the bidirectional attention inside the image is applied as transformers does."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_bundle, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(gemma3_bundle)
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        emb = model.get_image_features(pixel_values=pixels).pooler_output[0]  # [16, hidden]
    req = make_request("what is this?", max_tokens=20, ignore_eos=True)
    r = post(gemma_service, req, {"mm.0": emb})
    assert r.status_code == 200, r.text
    msgs = [{"role": "system", "content": [{"type": "text", "text": "you are a helpful assistant"}]},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image"}]}]
    ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"]
    img = model.config.image_token_id
    k = ids.index(img)
    ids = torch.tensor([ids[:k] + [img] * 16 + ids[k + 1 :]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == img).long(),
                             attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=[])  # ignore_eos
    assert r.json()["token_ids"] == out[0, ids.shape[1] :].tolist()


def test_gemma3_refuses_audio(gemma_service):
    req = GenerateRequest(request_id="a1", messages=[PromptMessage(role="user", content=[
        PromptText(text="listen"), PromptMedia(modality="audio", index=0, content_hash="x", num_tokens=4)])])
    r = post(gemma_service, req, {"mm.0": torch.zeros(4, 64)})
    assert r.status_code == 400
    assert "audio" in r.json()["error"]["message"]


def test_repeated_prompt_reports_cached_tokens(mimo_service, mimo_image):
    first = post(mimo_service, make_request("a long shared question " * 8, max_tokens=6, rid="c1"),
                 {"mm.0": mimo_image}).json()
    second = post(mimo_service, make_request("a long shared question " * 8, max_tokens=6, rid="c2"),
                  {"mm.0": mimo_image}).json()
    assert second["token_ids"] == first["token_ids"]
    if mimo_service.backend == "swa":
        assert 0 < second["cached_tokens"] < second["prompt_tokens"]
        assert _metric(mimo_service, "mmserve_llm_prefix_hit_tokens_total") >= second["cached_tokens"]
    else:
        assert second["cached_tokens"] == 0


def test_concurrent_requests_equal_sequential(mimo_service, mimo_image):
    import asyncio

    texts = [f"question number {i} about colors and shapes" for i in range(6)]
    seq = [post(mimo_service, make_request(t, max_tokens=10, ignore_eos=True, rid=f"q{i}"),
                {"mm.0": mimo_image}).json()["token_ids"] for i, t in enumerate(texts)]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[
                c.post(mimo_service.url + "/v1/generate",
                       content=pack({"mm.0": mimo_image}, make_request(t, max_tokens=10, ignore_eos=True, rid=f"p{i}")))
                for i, t in enumerate(texts)])
        return [r.json()["token_ids"] for r in rs]

    assert asyncio.run(all_at_once()) == seq


def test_non_stream_client_disconnect_aborts_request(mimo_service, mimo_image):
    before = _metric(mimo_service, "mmserve_llm_requests_total", 'finish_reason="abort"')
    req = make_request("keep talking", max_tokens=400, ignore_eos=True, rid="r-gone-plain")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(mimo_service.url + "/v1/generate", content=pack({"mm.0": mimo_image}, req), timeout=0.5)
    deadline = time.monotonic() + 60
    while _metric(mimo_service, "mmserve_llm_requests_total", 'finish_reason="abort"') <= before:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    body = post(mimo_service, make_request("next", max_tokens=3, rid="r-gone-plain"), {"mm.0": mimo_image}).json()
    assert body["completion_tokens"] >= 1


def test_logprobs_of_greedy_tokens(mimo_service, mimo_bundle, mimo_image):
    req = make_request("what is in this picture?", max_tokens=6, ignore_eos=True, rid="lp")
    req.return_logprobs = True
    body = post(mimo_service, req, {"mm.0": mimo_image}).json()
    assert len(body["logprobs"]) == len(body["token_ids"]) == 6
    assert all(lp <= 0.0 for lp in body["logprobs"])
    # the reference: transformers' log-softmax of the greedy tokens on the full sequence
    from transformers import MiMoV2FlashForCausalLM

    model = MiMoV2FlashForCausalLM.from_pretrained(mimo_bundle, attn_implementation="eager").eval()
    ref_ids = reference_generate(mimo_bundle, req, mimo_image, 1)  # prompt handling as in the oracle
    assert ref_ids[0] == body["token_ids"][0]
    assert body["logprobs"][0] == pytest.approx(_first_logprob(model, mimo_bundle, req, mimo_image), abs=1e-4)
    plain = post(mimo_service, make_request("what is in this picture?", max_tokens=6, rid="lp2"),
                 {"mm.0": mimo_image}).json()
    assert plain["logprobs"] is None


def _first_logprob(model, bundle, req, emb) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundle)
    ids, x = _reference_embeds(model, tok, req, emb)
    with torch.no_grad():
        logits = model(inputs_embeds=x).logits[0, -1]
    return float(torch.log_softmax(logits.float(), -1).max())
