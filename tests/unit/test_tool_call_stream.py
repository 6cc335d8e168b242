"""Tool calls streamed through the services without a model: a family parser's pieces through the
LLM service's shaper (``llm_svc.front.output_shape``), the chat SSE writer and the Responses event
writer. A call's id and name come once, on its first piece; its argument pieces concatenate to
the non-streamed answer's arguments, whatever the increments; finish_reason is tool_calls."""

from __future__ import annotations

import json
import random

import pytest

from gateway.openai_api.responses_api import ResponsesRequest
from gateway.openai_format import ChunkWriter, chat_completion
from gateway.responses_format import ResponsesEventWriter, ResponseShell, response_object
from llm_svc.front.output_shape import OutputShaper, merge_calls
from llm_svc.parsers import output_parser
from shared.schemas import GenerateResponse
from tests.unit.test_output_parsers import TOOLS

pytestmark = pytest.mark.unit

TEXT = ("<think>plan</think>Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
        "<parameter=days>3</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n"
        "</tool_call>")
ARGS = [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}")]


def shaped(pieces: list[str]):
    shaper = OutputShaper(output_parser("mimo", None, tools=TOOLS), "auto", True)
    return [shaper.shape([], p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]


def splits(rng: random.Random) -> list[list[str]]:
    out = [[TEXT], list(TEXT)]
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 20)))
        out.append([TEXT[a:b] for a, b in zip([0] + cuts, cuts + [len(TEXT)])])
    return out


def response(calls) -> GenerateResponse:
    return GenerateResponse(request_id="r", text="Checking.", reasoning="plan", tool_calls=calls, token_ids=[1],
                            finish_reason="tool_calls", prompt_tokens=3, completion_tokens=1)


def test_shaped_pieces_concatenate_to_the_whole_answer():
    for pieces in splits(random.Random(0)):
        out = shaped(pieces)
        assert out[-1].finish_reason == "tool_calls"
        flat = [c for s in out for c in s.tool_calls or ()]
        for s in out:  # one entry per call in a chunk, however many tokens it had
            idx = [c.index for c in s.tool_calls or ()]
            assert len(idx) == len(set(idx))
        assert [(c.index, c.name) for c in flat if c.id] == [(0, "get_weather"), (1, "now")]
        assert all(c.name is None for c in flat if not c.id)
        assert [(c.name, c.arguments) for c in merge_calls(flat)] == ARGS
    one_piece = shaped([TEXT])[-1].tool_calls
    assert [(c.name, c.arguments) for c in one_piece] == ARGS  # all at once: each call whole, in one entry
    by_char = [c for s in shaped(list(TEXT)) for c in s.tool_calls or () if c.index == 0]
    assert [c.arguments for c in by_char] == ["", '{"city": "Paris"', ', "days": 3', "}"]


def test_chat_stream_and_message_agree():
    out = shaped(list(TEXT))
    w = ChunkWriter("chatcmpl-1", 5, "m", include_usage=False)
    deltas = [json.loads(w.content(s.content, None, s.reasoning, s.tool_calls)[6:])["choices"][0]["delta"]
              for s in out if s.tool_calls]
    streamed: dict[int, dict] = {}
    for d in deltas:
        for t in d["tool_calls"]:
            if t["index"] in streamed:  # OpenAI's shape: only the first piece names the call
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
                streamed[t["index"]]["arguments"] += t["function"]["arguments"]
            else:
                assert t["type"] == "function" and t["id"].startswith("call_")
                streamed[t["index"]] = {"id": t["id"], **t["function"]}
    msg = chat_completion([response(merge_calls([c for s in out for c in s.tool_calls or ()]))], "m", "c", 1) \
        .choices[0].message
    assert [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [(c["id"], c["name"], c["arguments"]) for _, c in sorted(streamed.items())]


def events(chunks: list[bytes]) -> list[dict]:
    return [json.loads(block.split(b"data: ", 1)[1]) for c in chunks for block in c.split(b"\n\n") if block]


def test_responses_stream_sends_argument_deltas_as_they_come():
    out = shaped(list(TEXT))
    shell = ResponseShell(ResponsesRequest(model="m", input="hi"), 1)
    w = ResponsesEventWriter(shell)
    chunks = w.opening() + [w.content(s.content, None, s.reasoning, s.tool_calls) for s in out]
    chunks += [w.finish(out[-1].finish_reason), w.usage(3, 1, 0)]
    evs = events(chunks)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    added = [e for e in evs if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(added)))
    assert [e["item"]["type"] for e in added] == ["reasoning", "message", "function_call", "function_call"]
    # the first call's name and argument deltas come before the output ends, not all at the finish
    assert b"response.function_call_arguments.delta" in b"".join(chunks[2:2 + len(out) - 1])
    final = evs[-1]["response"]
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    for pos, item in enumerate(final["output"]):
        if item["type"] != "function_call":
            continue
        pieces = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == pos]
        done = [e for e in evs if e["type"] == "response.function_call_arguments.done" and e["output_index"] == pos]
        assert len(pieces) >= 1 and "".join(pieces) == done[0]["arguments"] == item["arguments"]
        assert {e["item_id"] for e in evs if e.get("output_index") == pos and "item_id" in e} == {item["id"]}
    assert [(c["name"], c["arguments"]) for c in calls] == ARGS
    assert len([e for e in evs if e["type"] == "response.function_call_arguments.delta"
                and e["output_index"] == 2]) == 3
    whole = response_object(shell, response(merge_calls([c for s in out for c in s.tool_calls or ()])))
    assert [(o["type"], o.get("arguments")) for o in whole["output"]] == \
        [(o["type"], o.get("arguments")) for o in final["output"]]
