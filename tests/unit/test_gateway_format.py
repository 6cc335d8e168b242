import asyncio
import json

import httpx
import pytest
import torch

from gateway.media.items import MediaItem
from gateway.openai_api.answers import ChunkChoice, DeltaMessage
from gateway.openai_api.requests import ChatCompletionRequest
from gateway.openai_api.answer_format import SSE_DONE, ChunkWriter, chat_completion
from gateway.pipeline.prompt import build_generate_request, pack_generate, sampling_params
from mmserve.testing.fake_services import filled
from gateway.routing.inflight import InFlightWaits
from gateway.upstream import Encoded, LLMStream, UpstreamError
from shared.schemas import EncodeResult, GenerateChunk, GenerateRequest, GenerateResponse, PromptMedia
from shared.wire import unpack

pytestmark = pytest.mark.unit


def parse(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[6:])


def encoded(index: int, modality: str, n: int, fill: float) -> Encoded:
    item = MediaItem(index, modality, f"w{index}", b"x", f"{index:032x}")
    res = EncodeResult(modality=modality, content_hash=item.content_hash, model="e", num_tokens=n, hidden_size=4)
    return Encoded(item, res, "r", embeds=filled(n, 4, fill))  # packed as shared.wire reads it


def test_chunk_writer_events():
    w = ChunkWriter("chatcmpl-1", 5, "m", include_usage=True)
    role = parse(w.role())
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["object"] == "chat.completion.chunk" and role["usage"] is None
    assert parse(w.content("hi"))["choices"][0]["delta"] == {"content": "hi"}
    fin = parse(w.finish("length"))
    assert fin["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}  # OpenAI's nulls
    u = parse(w.usage(10, 3, 4))
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                                 "prompt_tokens_details": {"cached_tokens": 4}}
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert "usage" not in parse(ChunkWriter("c", 1, "m", include_usage=False).content("x"))


@pytest.mark.parametrize("include_usage", [True, False])
def test_text_delta_events_are_the_models_bytes(include_usage):
    """A text-only delta is written from bytes cut once from the models' own event: the same bytes."""
    w = ChunkWriter("chatcmpl-1", 5, "m\\u0000\"", include_usage=include_usage)
    for index in (0, 3):
        for text in ["", " hello", 'q"\\ \n\t\x00\x1f \u00e9 \u2028 \U0001f600']:
            full = w._chunk([ChunkChoice(index=index, delta=DeltaMessage(content=text))])
            assert w.content(text, index=index) == full


def test_llm_stream_yields_the_chunks_of_each_read_together_and_the_good_ones_before_a_bad_line():
    class Router:
        def end(self, replica):
            pass

    async def run(reads: list[bytes]) -> list:
        async def body():
            for r in reads:
                yield r

        stream, got = LLMStream(httpx.Response(200, content=body()), "r", Router(), InFlightWaits()), []
        try:
            async for batch in stream.batches():
                got.append([c.text for c in batch])
        except UpstreamError as e:
            got.append(e.message.split(":")[0])
        return got

    a, b, c = (GenerateChunk(request_id="x", text=t).model_dump_json().encode() for t in "abc")
    assert asyncio.run(run([a + b"\n" + b[:5], b[5:] + b"\n" + c + b"\n", b"\n"])) == [["a"], ["b", "c"]]
    assert asyncio.run(run([a + b"\n{bad\n" + c + b"\n"])) == [["a"], "LLM stream from r sent a bad chunk"]
    assert asyncio.run(run([a + b"\n" + c])) == [["a"], ["c"]]  # the last line without its newline


def test_llm_stream_reads_a_finished_body_to_its_end_before_closing_and_an_unfinished_one_not():
    """A finished generation's connection is left reusable (its body read to the end); closing an
    unfinished one (the client left) must not wait for more of it: the close aborts upstream."""

    class Router:
        def end(self, replica):
            pass

    async def run(finish: str | None) -> list[str]:
        seen = []

        async def body():
            seen.append("first")
            yield GenerateChunk(request_id="x", text="a", finish_reason=finish).model_dump_json().encode() + b"\n"
            seen.append("end")

        stream = LLMStream(httpx.Response(200, content=body()), "r", Router(), InFlightWaits())
        async for _ in stream.batches():
            break  # as the chat route does once every choice has finished
        await stream.aclose()
        await stream.aclose()  # twice is fine
        return seen

    assert asyncio.run(run("stop")) == ["first", "end"]
    assert asyncio.run(run(None)) == ["first"]


def test_chat_completion_body():
    resp = GenerateResponse(request_id="r", text="ok", token_ids=[1], finish_reason="stop",
                            prompt_tokens=7, completion_tokens=1, cached_tokens=5)
    body = chat_completion([resp], "m", "chatcmpl-1", 9).model_dump()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert body["usage"]["total_tokens"] == 8 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 5


def test_generate_request_places_media_in_order():
    req = ChatCompletionRequest(model="m", max_tokens=9, stop="END", temperature=0.5, messages=[
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,a"}},
            {"type": "text", "text": "between"},
            {"type": "input_audio", "input_audio": {"data": "AAAA"}},
        ]},
    ])
    enc = [encoded(0, "image", 3, 1.0), encoded(1, "audio", 2, 2.0)]
    gen = build_generate_request(req, enc, "id1", default_max_tokens=64)
    assert [p.type for p in gen.messages[1].content] == ["media", "text", "media"]
    m0, m1 = gen.messages[1].content[0], gen.messages[1].content[2]
    assert isinstance(m0, PromptMedia) and (m0.index, m0.num_tokens, m0.modality) == (0, 3, "image")
    assert (m1.index, m1.num_tokens, m1.modality) == (1, 2, "audio")
    assert gen.sampling.max_tokens == 9 and gen.sampling.stop == ["END"] and gen.sampling.temperature == 0.5
    tensors, back = unpack(pack_generate(gen, enc), GenerateRequest)
    assert back == gen and tensors["mm.1"].shape == (2, 4) and float(tensors["mm.1"][0, 0]) == 2.0


def test_text_only_request_packs_without_tensors():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    gen = build_generate_request(req, [], "id", 64)
    tensors, back = unpack(pack_generate(gen, []), GenerateRequest)
    assert tensors == {} and back.messages[0].content[0].text == "hi" and back.sampling.max_tokens == 64


def test_sampling_defaults_are_the_llm_defaults():
    s = sampling_params(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]), 32)
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (32, 0.0, 1.0, -1, None)
    s = sampling_params(ChatCompletionRequest(model="m", max_completion_tokens=5, max_tokens=7, top_k=4, seed=1,
                                              messages=[{"role": "user", "content": "x"}]), 32)
    assert (s.max_tokens, s.top_k, s.seed) == (5, 4, 1)


def test_vllm_length_extensions_reach_the_sampling_params():
    msgs = [{"role": "user", "content": "x"}]
    s = sampling_params(ChatCompletionRequest(model="m", messages=msgs, max_tokens=9, min_tokens=9, ignore_eos=True), 32)
    assert (s.max_tokens, s.min_tokens, s.ignore_eos) == (9, 9, True)
    s = sampling_params(ChatCompletionRequest(model="m", messages=msgs, min_tokens=50), 32)
    assert (s.max_tokens, s.min_tokens) == (50, 50)  # no cap given: the default rises to min_tokens
    with pytest.raises(ValueError, match="min_tokens"):
        ChatCompletionRequest(model="m", messages=msgs, max_tokens=4, min_tokens=5)


def test_repeated_media_pack_as_separate_tensors():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA"}},
    ]}])
    one = encoded(0, "audio", 2, 5.0)
    two = Encoded(MediaItem(1, "audio", "w1", b"x", one.item.content_hash), one.result, "r", embeds=one.embeds)
    gen = build_generate_request(req, [one, two], "id", 8)
    tensors, _ = unpack(pack_generate(gen, [one, two]), GenerateRequest)
    assert torch.equal(tensors["mm.0"], tensors["mm.1"])


def test_by_reference_items_travel_as_key_and_sources_without_a_tensor():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,a"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA"}},
    ]}])
    item = MediaItem(0, "image", "w0", b"x", "ab" * 32)
    res = EncodeResult(modality="image", content_hash=item.content_hash, model="e", num_tokens=16, hidden_size=4,
                       key="enc:image:sig:" + item.content_hash, by_ref=True)
    ref = Encoded(item, res, "http://e0", sources=("http://e0", "http://e1"))
    by_value = encoded(1, "audio", 2, 3.0)
    gen = build_generate_request(req, [ref, by_value], "id", 8)
    body = pack_generate(gen, [ref, by_value])
    tensors, back = unpack(body, GenerateRequest)
    assert set(tensors) == {"mm.1"}  # the image travels as its key alone
    m0 = back.media()[0]
    assert (m0.key, m0.sources, m0.num_tokens) == (res.key, ["http://e0", "http://e1"], 16)
    assert back.media()[1].sources == []
    assert len(body) < 1280 + 256  # the header alone (JSON of the request), no image tensor bytes (16 x 4 x 4)


def _prompt_entries() -> list:
    from shared.schemas import PromptTokenLogprob, TokenLogprob

    alt = [TokenLogprob(token_id=7, token=" b", logprob=-0.5), TokenLogprob(token_id=3, token=" c", logprob=-1.5)]
    return [PromptTokenLogprob(token_id=5, token="a"),
            PromptTokenLogprob(token_id=3, token=" c", logprob=-1.5, rank=2, top=alt)]


def test_echo_with_logprobs_leads_with_the_prompt_and_vllm_prompt_logprobs():
    from gateway.openai_api.answer_format import CompletionChunkWriter, text_completion
    from shared.schemas import SampledLogprob

    out = [SampledLogprob(token_id=9, token="!", logprob=-0.1)]
    resp = GenerateResponse(request_id="r", text="a c!", token_ids=[9], finish_reason="length", prompt_tokens=2,
                            completion_tokens=1, token_logprobs=out, prompt_logprobs=_prompt_entries())
    body = text_completion([resp], "m", "cmpl-1", 1, True, echo_top=1, prompt_top=2).model_dump()
    lp = body["choices"][0]["logprobs"]
    assert lp == {"tokens": ["a", " c", "!"], "token_logprobs": [None, -1.5, -0.1],
                  "top_logprobs": [None, {" b": -0.5}, {}], "text_offset": [0, 1, 3]}
    assert body["choices"][0]["prompt_logprobs"] == [None, {
        3: {"logprob": -1.5, "rank": 2, "decoded_token": " c"}, 7: {"logprob": -0.5, "rank": 1, "decoded_token": " b"}}]
    plain = text_completion([resp], "m", "cmpl-1", 1, True).model_dump()["choices"][0]
    assert "prompt_logprobs" not in plain and plain["logprobs"]["tokens"] == ["!"]
    w = CompletionChunkWriter("cmpl-1", 1, "m", False, True, echo_top=1)
    first = parse(w.content("a c!", out, prompt_logprobs=_prompt_entries()))["choices"][0]["logprobs"]
    assert first == lp
    assert parse(w.content("?", [SampledLogprob(token_id=8, token="?", logprob=-2.0)]))["choices"][0]["logprobs"][
        "text_offset"] == [4]


def test_prompt_logprobs_reach_the_sampling_params():
    from gateway.openai_api.requests import CompletionRequest

    def k(**kw):
        return sampling_params(CompletionRequest(model="m", prompt="x", **kw), 16).prompt_logprobs

    assert k() is None and k(logprobs=2) is None and k(echo=True) is None
    assert k(echo=True, logprobs=2) == 2 and k(echo=True, logprobs=2, stream=True) == 2
    assert k(prompt_logprobs=4) == 4 and k(echo=True, logprobs=1, prompt_logprobs=3) == 3
    assert sampling_params(CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0), 16).max_tokens == 0
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], prompt_logprobs=1)
    assert sampling_params(chat, 16).prompt_logprobs == 1
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"max_tokens": 0}, {"prompt_logprobs": 21}):
        with pytest.raises(ValueError):
            CompletionRequest(model="m", prompt="x", **bad)


def test_responses_logprobs_ride_on_text_deltas_and_concatenate_to_done():
    """A token that adds no text rides on the next delta; what is left goes on a last empty delta;
    the deltas' logprobs concatenate to the done event's and the item's (which has bytes)."""
    from gateway.openai_api.responses_format import ResponsesEventWriter, ResponseShell
    from gateway.openai_api.responses_api import ResponsesRequest
    from shared.schemas import SampledLogprob, TokenLogprob

    def e(tok: str, lp: float) -> SampledLogprob:
        return SampledLogprob(token_id=1, token=tok, logprob=lp, top=[TokenLogprob(token_id=2, token=tok, logprob=lp)])

    def events(req: dict) -> list[dict]:
        w = ResponsesEventWriter(ResponseShell(ResponsesRequest(model="m", input="x", stream=True, **req), 1))
        raw = b"".join([*w.opening(), w.content("", [e("<", -1.0)]), w.content("hi", [e("hi", -0.5)]),
                        w.content("", [e(">", -2.0)]), w.finish("stop")])
        return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]

    ev = events({"top_logprobs": 1})
    deltas = [x for x in ev if x["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["hi", ""]
    assert [[lp["token"] for lp in d["logprobs"]] for d in deltas] == [["<", "hi"], [">"]]
    done = next(x for x in ev if x["type"] == "response.output_text.done")
    assert done["logprobs"] == [lp for d in deltas for lp in d["logprobs"]]
    assert done["logprobs"][0] == {"token": "<", "logprob": -1.0, "top_logprobs": [{"token": "<", "logprob": -1.0}]}
    item = next(x for x in ev if x["type"] == "response.output_item.done")["item"]
    assert item["content"][0]["logprobs"][1] == {"token": "hi", "logprob": -0.5, "bytes": [104, 105],
                                                 "top_logprobs": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105]}]}
    plain = events({})
    assert all(x["logprobs"] == [] for x in plain if x["type"].startswith("response.output_text."))
    assert [x["delta"] for x in plain if x["type"] == "response.output_text.delta"] == ["hi"]
    with pytest.raises(ValueError, match="file_search_call.results"):
        ResponsesRequest(model="m", input="x", include=["file_search_call.results"])
