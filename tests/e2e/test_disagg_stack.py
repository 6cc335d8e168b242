"""Prefill / decode disaggregation through the whole stack: the gateway pairs a prefill and a
decode replica (real processes, real HTTP, the hand-over over real TCP between their engine
cores), called with the official openai client, against a unified stack of the same checkpoint
(docs/disagg.md)."""

from __future__ import annotations

import re
import signal
import time

import httpx
import openai
import pytest

from mmserve.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.e2e

LONG = "Summarise the following notes. " + " ".join(f"note {i}: the tide came in at dawn." for i in range(40))


def _stack(model, tmp, **kw) -> LocalStack:
    spec = StackSpec(model_dir=str(model), gateway_port=0, encoders=1, **kw)
    return LocalStack(spec, log_dir=tmp)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    from mmserve.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("pd") / "mimo16", sliding_window=16)
    unified = _stack(model, tmp_path_factory.mktemp("unified-logs"))
    pd = _stack(model, tmp_path_factory.mktemp("pd-logs"), prefill_llms=1,
                gateway_env={"disagg_min_prompt_tokens": "64", "disagg_idle_min_prompt_tokens": "64"})
    with unified, pd:
        unified.wait_ready(timeout=240)
        pd.wait_ready(timeout=240)
        yield unified, pd


def _chat(stack, text: str, stream: bool, max_tokens: int = 16):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": text}]
    if not stream:
        r = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=max_tokens,
                                           temperature=0)
        return r.choices[0].message.content, r.choices[0].finish_reason
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(pieces), finish


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_pd_pair_behind_the_gateway_answers_as_a_unified_replica(stacks, stream):
    unified, pd = stacks
    decode = pd.llms[0].url
    remote = _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="remote")
    adopted = _metric(decode, "mmserve_llm_handover", event="adopted")
    short = _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="local_short")
    tag = "streamed" if stream else "whole"  # prompts the decode replica has not seen: cached ones stay local
    for text in (f"{tag}: {LONG}", f"{tag}: {LONG.replace('dawn', 'dusk')}", "hi"):
        assert _chat(pd, text, stream) == _chat(unified, text, stream)
    # the two long prompts went prefill -> decode, the short one stayed on its decode replica
    # (the same long prompt again is mostly in the decode replica's cache: prefilled there)
    cached = _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="local_cached")
    assert _chat(pd, f"{tag}: {LONG}", stream) == _chat(unified, f"{tag}: {LONG}", stream)
    assert _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="local_cached") == cached + 1
    assert _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="remote") == remote + 2
    assert _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="local_short") == short + 1
    assert _metric(decode, "mmserve_llm_handover", event="adopted") == adopted + 2
    assert _metric(decode, "mmserve_llm_handover", event="waiting") == 0
    assert _metric(pd.prefill_llms[0].url, "mmserve_llm_handover", event="sending") == 0


def test_a_dead_prefill_replica_costs_a_later_first_token_not_an_answer(stacks):
    unified, pd = stacks
    want = _chat(unified, LONG + " once more", False)
    pre = pd.prefill_llms[0]
    pre.proc.send_signal(signal.SIGKILL)
    pre.proc.wait(30)
    try:
        t0 = time.monotonic()
        assert _chat(pd, LONG + " once more", False) == want  # prefilled on the decode replica
        assert time.monotonic() - t0 < 60
        fell_back = sum(_metric(pd.llms[0].url, "mmserve_llm_remote_prefill_total", outcome=o)
                        for o in ("fallback_unreachable", "fallback_http_503", "fallback_timeout"))
        local = _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="local_no_prefill")
        assert fell_back + local >= 1
    finally:
        pd.restart(pre)
    # back in rotation: long prompts are prefilled remotely again
    deadline = time.monotonic() + 30
    remote = _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="remote")
    while time.monotonic() < deadline:
        _chat(pd, f"{time.monotonic()}: {LONG}", False, max_tokens=2)
        if _metric(pd.url, "mmserve_gateway_disagg_decisions_total", decision="remote") > remote \
                and _metric(pre.url, "mmserve_llm_handover", event="sent") >= 1:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the restarted prefill replica never prefilled again")


def test_a_dead_decode_replica_ends_the_stream_with_an_error_and_leaves_nothing_held(stacks):
    _, pd = stacks
    dec = pd.llms[0]
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=pd.model_name, max_tokens=2000, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": f"dying: {LONG}"}],
                                            extra_body={"ignore_eos": True})
    got_error = False
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and dec.alive():
                dec.proc.send_signal(signal.SIGKILL)  # mid-stream, after the hand-over
    except (openai.APIError, httpx.HTTPError):
        got_error = True
    assert got_error, "the stream of a killed decode replica must end with an error, not a clean finish"
    dec.proc.wait(30)
    pd.restart(dec)
    pre = pd.prefill_llms[0].url
    assert _metric(pre, "mmserve_llm_handover", event="sending") == 0
    # the pair serves again
    assert _chat(pd, f"after: {LONG}", False, max_tokens=4)[1] == "length"


def test_the_dashboard_shows_each_replicas_role_and_hand_overs(stacks):
    _, pd = stacks
    _chat(pd, f"dashboard: {LONG}", False, max_tokens=2)
    data = httpx.get(pd.url + "/dashboard/data", timeout=30).json()
    roles = {r["url"]: (r["role"], r["handovers"]) for r in data["llm"] if r["up"]}
    assert roles[pd.llms[0].url][0] == "decode" and roles[pd.prefill_llms[0].url][0] == "prefill"
    assert roles[pd.llms[0].url][1] >= 1 and roles[pd.prefill_llms[0].url][1] >= 1


def test_an_image_chat_is_prefilled_where_its_embeddings_are_fetched_and_decoded_from_the_hand_over(stacks):
    """Media sent by reference: the prefill replica fetches the embeddings from the encoder, the
    decode replica continues from the KV without them."""
    import base64

    from tests.conftest import make_png

    unified, pd = stacks
    png = "data:image/png;base64," + base64.b64encode(make_png(seed=11)).decode()
    content = [{"type": "text", "text": f"image: {LONG}"}, {"type": "image_url", "image_url": {"url": png}}]

    def ask(stack):
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=stack.model_name, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": content}])
        return r.choices[0].message.content, r.choices[0].finish_reason

    decode, pre = pd.llms[0].url, pd.prefill_llms[0].url
    adopted = _metric(decode, "mmserve_llm_handover", event="adopted")
    fetched = _metric(pre, "mmserve_llm_media_refs_total", outcome="fetched")
    assert ask(pd) == ask(unified)
    assert _metric(decode, "mmserve_llm_handover", event="adopted") == adopted + 1
    assert _metric(pre, "mmserve_llm_media_refs_total", outcome="fetched") >= fetched + 1
