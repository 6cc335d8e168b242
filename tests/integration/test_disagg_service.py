"""Prefill / decode disaggregation through the LLM service: three real replicas (uvicorn fronts
in threads, each with its engine-core process), the hand-over over real TCP between the two
cores, against a unified replica of the same checkpoint (docs/disagg.md)."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from shared.service_auth import token_headers
from shared.schemas import GenerateRequest, KVTransferParams, PromptMessage, PromptText, SamplingParams
from shared.wire import SAFETENSORS_MIME, pack
from tests.integration.test_llm_service import image_embeds, make_request, start_service

pytestmark = pytest.mark.integration

W = 16
TOKEN = "pd-test-token-0123456789"  # every replica's service token: the hand-over proves it too


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from mmserve.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("pd") / "mimo16", sliding_window=W)
    both = start_service(model, "swa", service_token=TOKEN)
    prefill = start_service(model, "swa", role="prefill", service_token=TOKEN)
    decode = start_service(model, "swa", role="decode", handover_timeout_s=5.0, service_token=TOKEN)
    with both, prefill, decode:
        yield {"both": both, "prefill": prefill, "decode": decode, "model": model}


def _gen(rid: str, text: str, max_tokens: int = 12, stream: bool = False, kt: KVTransferParams | None = None,
         **sampling) -> GenerateRequest:
    return GenerateRequest(request_id=rid, messages=[PromptMessage(role="user", content=[PromptText(text=text)])],
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),
                           stream=stream, kv_transfer_params=kt)


def _post(svc, req: GenerateRequest, tensors: dict | None = None) -> httpx.Response:
    return httpx.post(svc.url + "/v1/generate", content=pack(tensors or {}, req),
                      headers={"content-type": SAFETENSORS_MIME, **token_headers(TOKEN)}, timeout=120)


def _tokens(r: httpx.Response, stream: bool) -> tuple[list[int], str]:
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        return body["token_ids"], body["finish_reason"]
    ids, reason = [], None
    for line in r.text.splitlines():
        chunk = json.loads(line)
        ids += chunk.get("token_ids", [])
        reason = chunk.get("finish_reason") or reason
    return ids, reason


def _metric(svc, name: str, **labels) -> float:
    text = httpx.get(svc.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _remote(svc) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, remote_prefill_url=svc.url)


PROMPTS = ["tell me a long story about " + "the sea and its waves " * 12,  # several windows
           "hi there", "count: " + " ".join(str(i) for i in range(40))]


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_replica_with_a_remote_prefill_gives_the_unified_tokens(replicas, stream):
    before = _metric(replicas["decode"], "mmserve_llm_remote_prefill_total", outcome="handed_over")
    adopted = _metric(replicas["decode"], "mmserve_llm_handover", event="adopted")
    by_nixl = _metric(replicas["prefill"], "mmserve_llm_handover", event="sent_nixl")
    for i, text in enumerate(PROMPTS):
        want = _tokens(_post(replicas["both"], _gen(f"u{i}{stream}", text, stream=stream)), stream)
        got = _tokens(_post(replicas["decode"], _gen(f"d{i}{stream}", text, stream=stream,
                                                      kt=_remote(replicas["prefill"]))), stream)
        assert got == want, text[:40]
        assert len(got[0]) == 12 and got[1] == "length"
    d = replicas["decode"]
    assert _metric(d, "mmserve_llm_remote_prefill_total", outcome="handed_over") == before + len(PROMPTS)
    # every request continued from the KV that crossed the wire, none recomputed
    assert _metric(d, "mmserve_llm_handover", event="adopted") == adopted + len(PROMPTS)
    assert _metric(d, "mmserve_llm_handover", event="waiting") == 0
    assert _metric(d, "mmserve_llm_handover", event="held") == 0
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="sent") >= len(PROMPTS)
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="sending") == 0
    # kv_transport auto, NIXL installed on both: the pages went by NIXL
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="sent_nixl") == by_nixl + len(PROMPTS)


def test_a_prefill_replica_on_the_tcp_transport_hands_over_to_a_decode_replica_with_nixl(replicas):
    """kv_transport tcp on the prefill side only: the decode replica (auto: NIXL) takes the pages
    on the stream, and the tokens are the unified replica's."""
    adopted = _metric(replicas["decode"], "mmserve_llm_handover", event="adopted")
    with start_service(replicas["model"], "swa", role="prefill", kv_transport="tcp", service_token=TOKEN) as pre:
        want = _tokens(_post(replicas["both"], _gen("u-tcp", PROMPTS[0])), False)
        got = _tokens(_post(replicas["decode"], _gen("d-tcp", PROMPTS[0], kt=_remote(pre))), False)
        assert got == want
        assert _metric(pre, "mmserve_llm_handover", event="sent") == 1
        assert _metric(pre, "mmserve_llm_handover", event="sent_nixl") == 0
    assert _metric(replicas["decode"], "mmserve_llm_handover", event="adopted") == adopted + 1


def test_a_first_token_that_ends_the_request_is_the_answer_without_a_hand_over(replicas):
    want = _tokens(_post(replicas["both"], _gen("u-one", PROMPTS[0], max_tokens=1)), False)
    sent = _metric(replicas["prefill"], "mmserve_llm_handover", event="sent")
    got = _tokens(_post(replicas["decode"], _gen("d-one", PROMPTS[0], max_tokens=1, kt=_remote(replicas["prefill"]))),
                  False)
    assert got == want and got[1] == "length"
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="sent") == sent
    assert _metric(replicas["decode"], "mmserve_llm_remote_prefill_total", outcome="finished") >= 1


def test_an_unreachable_prefill_replica_is_prefilled_locally_with_the_same_tokens(replicas):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    want = _tokens(_post(replicas["both"], _gen("u-dead", PROMPTS[2])), False)
    kt = KVTransferParams(do_remote_prefill=True, remote_prefill_url=dead)
    got = _tokens(_post(replicas["decode"], _gen("d-dead", PROMPTS[2], kt=kt)), False)
    assert got == want
    assert _metric(replicas["decode"], "mmserve_llm_remote_prefill_total", outcome="fallback_unreachable") >= 1


def test_a_prefill_replica_whose_hand_over_cannot_be_sent_answers_503(replicas):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kt = KVTransferParams(do_remote_decode=True, remote_host="127.0.0.1", remote_port=port)
    failures = _metric(replicas["prefill"], "mmserve_llm_handover", event="send_failures")
    r = _post(replicas["prefill"], _gen("p-dead", PROMPTS[0], kt=kt))
    assert r.status_code == 503, r.text
    assert "hand-over to the decode replica failed" in r.json()["error"]["message"]
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="send_failures") == failures + 1
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="sending") == 0


def test_roles_refuse_the_transfer_they_do_not_play_and_what_does_not_travel(replicas):
    r = _post(replicas["both"], _gen("x1", "hi", kt=_remote(replicas["prefill"])))
    assert r.status_code == 400 and "needs a decode replica" in r.json()["error"]["message"]
    kt = KVTransferParams(do_remote_decode=True, remote_host="127.0.0.1", remote_port=1)
    r = _post(replicas["decode"], _gen("x2", "hi", kt=kt))
    assert r.status_code == 400 and "needs a prefill replica" in r.json()["error"]["message"]
    kt = KVTransferParams(do_remote_decode=True, remote_host="127.0.0.1", remote_port=1)
    r = _post(replicas["prefill"], _gen("x3", "hi", kt=kt, prompt_logprobs=1))
    assert r.status_code == 400 and "not handed over between replicas yet" in r.json()["error"]["message"]
    # asked of a decode replica, what does not travel is served there alone, with the unified answer
    fallback = _metric(replicas["decode"], "mmserve_llm_remote_prefill_total", outcome="fallback_unsupported")
    want = _post(replicas["both"], _gen("x4", "hi", prompt_logprobs=1)).json()
    got = _post(replicas["decode"], _gen("x5", "hi", kt=_remote(replicas["prefill"]), prompt_logprobs=1)).json()
    assert got["token_ids"] == want["token_ids"] and got["prompt_logprobs"] == want["prompt_logprobs"]
    assert _metric(replicas["decode"], "mmserve_llm_remote_prefill_total",
                   outcome="fallback_unsupported") == fallback + 1
    with pytest.raises(ValueError, match="exactly one of"):
        KVTransferParams(do_remote_decode=True, do_remote_prefill=True, remote_host="h", remote_port=1,
                         remote_prefill_url="http://p")


def test_a_hand_over_names_only_allowed_peers_and_a_forged_one_is_refused_unread(replicas):
    """kv_peer_allow (default: this machine): a decode replica does not call, and send its token
    to, a prefill URL outside it; a prefill replica does not send KV to an address outside it. A
    peer without the service token is refused on the hand-over port before its head is read."""
    outside = "http://10.255.255.1:8200"  # a call there would fail and fall back: 200; refused: 400
    r = _post(replicas["decode"], _gen("peer-1", "hi", kt=KVTransferParams(do_remote_prefill=True,
                                                                          remote_prefill_url=outside)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_peer_not_allowed" and "MMSERVE_LLM_KV_PEER_ALLOW" in err["message"]
    assert "10.255.255.1" not in err["message"]
    kt = KVTransferParams(do_remote_decode=True, remote_host="10.255.255.1", remote_port=8300)
    sent = _metric(replicas["prefill"], "mmserve_llm_handover", event="sent")
    r = _post(replicas["prefill"], _gen("peer-2", PROMPTS[0], kt=kt))
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_peer_not_allowed", r.text
    assert _metric(replicas["prefill"], "mmserve_llm_handover", event="sent") == sent
    # a forged hand-over on the decode replica's port, answering the challenge without the token
    from tests.unit.test_handover_link import _answer, _handover
    from llm_svc.disagg.transport import frames

    d = replicas["decode"]
    port = httpx.get(d.url + "/readyz", timeout=10).json()["handover"]["port"]
    failures = _metric(d, "mmserve_llm_handover", event="auth_failures")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(_answer(s, b"not-the-token") + b"".join(frames(_handover("forged-1"))))
        s.settimeout(10)
        try:
            while s.recv(1 << 16):  # the replica closes the connection (a reset: bytes it left unread)
                pass
        except ConnectionResetError:
            pass
    import time

    deadline = time.monotonic() + 10
    while _metric(d, "mmserve_llm_handover", event="auth_failures") < failures + 1:
        assert time.monotonic() < deadline, "the forged hand-over was not counted"
        time.sleep(0.1)
    assert _metric(d, "mmserve_llm_handover", event="held") == 0


def test_readyz_names_the_role_and_the_decode_replicas_hand_over_address(replicas):
    d = httpx.get(replicas["decode"].url + "/readyz", timeout=10).json()
    assert d["role"] == "decode" and d["handover"]["host"] == "127.0.0.1" and d["handover"]["port"] > 0
    p = httpx.get(replicas["prefill"].url + "/readyz", timeout=10).json()
    assert p["role"] == "prefill" and "handover" not in p


def test_an_image_prompt_sent_by_value_is_handed_over_with_the_unified_tokens(replicas):
    """The embeddings travel to the prefill replica in the body; the decode replica continues from
    the KV (media keys in the prefix tree) and never runs the image rows itself."""
    emb = image_embeds(replicas["model"], seed=3)
    adopted = _metric(replicas["decode"], "mmserve_llm_handover", event="adopted")
    text = "describe the picture " * 8
    want = _tokens(_post(replicas["both"], make_request(text, rid="u-img", max_tokens=10, temperature=0.0),
                         {"mm.0": emb}), False)
    req = make_request(text, rid="d-img", max_tokens=10, temperature=0.0)
    req = req.model_copy(update={"kv_transfer_params": _remote(replicas["prefill"])})
    got = _tokens(_post(replicas["decode"], req, {"mm.0": emb}), False)
    assert got == want and len(got[0]) == 10
    assert _metric(replicas["decode"], "mmserve_llm_handover", event="adopted") == adopted + 1


@pytest.mark.parametrize("modality", ["video", "audio"])
def test_video_and_audio_prompts_sent_by_value_are_handed_over_with_the_unified_tokens(replicas, modality):
    """A video (two timestamped frame groups, each written after its MM:SS text) and an audio
    clip, their embeddings in the body as the encoders give them: prefilled on the prefill
    replica, continued from its KV on the decode replica, token for token the unified answer."""
    import torch

    from shared.schemas import MediaSegment, PromptMedia

    hidden = image_embeds(replicas["model"]).shape[1]
    emb = torch.randn(24, hidden, generator=torch.Generator().manual_seed(11)) * 0.5
    segments = [MediaSegment(start_s=0.0, num_tokens=12), MediaSegment(start_s=2.0, num_tokens=12)] \
        if modality == "video" else None

    def req(rid: str, kt=None) -> GenerateRequest:
        media = PromptMedia(modality=modality, index=0, content_hash=f"{modality}-11", num_tokens=24,
                            segments=segments)
        return GenerateRequest(request_id=rid, messages=[PromptMessage(role="user", content=[
            PromptText(text=f"what happens in this {modality}? " * 6), media])],
            sampling=SamplingParams(max_tokens=10, temperature=0.0), kv_transfer_params=kt)

    adopted = _metric(replicas["decode"], "mmserve_llm_handover", event="adopted")
    want = _tokens(_post(replicas["both"], req(f"u-{modality}"), {"mm.0": emb}), False)
    got = _tokens(_post(replicas["decode"], req(f"d-{modality}", _remote(replicas["prefill"])), {"mm.0": emb}),
                  False)
    assert got == want and len(got[0]) == 10
    assert _metric(replicas["decode"], "mmserve_llm_handover", event="adopted") == adopted + 1


def test_with_the_direct_path_down_the_decode_replica_loads_the_prompt_from_the_shared_redis_tier(
        replicas, redis_url):
    """Both replicas on one Redis L3 tier: the prefill replica writes the prompt's pages there as
    it prefills; its hand-over cannot be sent (a send limit no transfer meets), so the decode
    replica prefills locally and its L3 lookup finds those pages: most of the prompt is loaded,
    not recomputed, and the tokens are the unified replica's."""
    import time

    model = replicas["model"]
    # Redis deadlines a loaded CI machine meets (the defaults, 0.5 s, let an L3 command stalled
    # behind the suite's other processes count as an outage: the tier is skipped, by design)
    kw = dict(kv_l3_url=redis_url, kv_l3_ttl_s=600, kv_l3_page_tokens=32, service_token=TOKEN,
              kv_l3_timeout=5.0, kv_l3_prefetch_timeout=5.0)
    with start_service(model, "swa", role="prefill", handover_timeout_s=1e-6, **kw) as pre, \
            start_service(model, "swa", role="decode", **kw) as dec:
        text = f"the direct path is down {time.time_ns()} " + "and the tier holds it " * 12
        want = _tokens(_post(replicas["both"], _gen("u-l3", text)), False)
        r = _post(dec, _gen("d-l3", text, kt=_remote(pre)))
        got = _tokens(r, False)
        assert got == want
        assert _metric(dec, "mmserve_llm_remote_prefill_total", outcome="fallback_http_503") == 1
        assert _metric(pre, "mmserve_llm_handover", event="send_timeouts") == 1
        assert r.json()["cached_tokens"] >= r.json()["prompt_tokens"] // 32 * 32 - 32 > 0, _l3_events(pre, dec)


def _l3_events(pre, dec) -> str:
    """Each replica's non-zero L3 counters, short enough for an assertion message to keep whole."""
    out = []
    for name, svc in (("prefill", pre), ("decode", dec)):
        lines = [m for m in httpx.get(svc.url + "/metrics", timeout=10).text.splitlines()
                 if ("l3" in m) and not m.startswith("#") and not m.endswith(" 0.0")]
        out.append(f"{name}: " + "; ".join(m.replace("mmserve_llm_", "") for m in lines))
    return " | ".join(out)


def test_logprobs_of_every_token_are_the_unified_ones_the_first_from_the_prefill_replica(replicas):
    def ask(svc, rid, kt=None):
        req = _gen(rid, PROMPTS[2], max_tokens=6, kt=kt).model_copy(update={"return_logprobs": True, "top_logprobs": 2})
        r = _post(svc, req)
        assert r.status_code == 200, r.text
        return r.json()

    want, got = ask(replicas["both"], "u-lp"), ask(replicas["decode"], "d-lp", _remote(replicas["prefill"]))
    assert got["token_ids"] == want["token_ids"] and len(got["token_logprobs"]) == 6
    for g, w in zip(got["token_logprobs"], want["token_logprobs"]):
        assert g["token_id"] == w["token_id"] and g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [a["token_id"] for a in g["top"]] == [a["token_id"] for a in w["top"]] and len(g["top"]) == 2
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_a_json_schema_answer_continues_its_grammar_from_the_prefill_replicas_first_token(replicas):
    """The decode replica compiles the request's grammar and advances it over the first token the
    prefill replica sampled under the same grammar: the answer is the unified one, and valid."""
    import json as _json

    from shared.schemas import StructuredSpec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = StructuredSpec(kind="json", spec=_json.dumps(schema), any_whitespace=False)
    adopted = _metric(replicas["decode"], "mmserve_llm_handover", event="adopted")
    want = _post(replicas["both"], _gen("u-js", PROMPTS[0], max_tokens=60, structured=spec)).json()
    got = _post(replicas["decode"], _gen("d-js", PROMPTS[0], max_tokens=60, structured=spec,
                                         kt=_remote(replicas["prefill"]))).json()
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert _metric(replicas["decode"], "mmserve_llm_handover", event="adopted") == adopted + 1
    if want["finish_reason"] == "stop":  # ended by the grammar (not cut at max_tokens): it parses
        assert set(_json.loads(got["text"])) == {"name", "n"}
