"""The front keys each request to the engine core by an id of its own, so a client id reused
right after its request ended (the gateway re-sends by value under the same id when media by
reference was gone) is never ended by the earlier request's abort or late outputs."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
from transformers import AutoTokenizer

from llm_svc.core.client import EngineCoreClient, _Core
from llm_svc.types.messages import CoreAbort, CoreAdd, CoreInput, CoreToken
from llm_svc.core.media_fetch import MEDIA_UNAVAILABLE
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from shared.settings import LLMSettings


class Wire:
    """The core's end of the front's input socket: what the front sent, decoded."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.connect(addr)
        self.dec = msgspec.msgpack.Decoder(CoreInput)

    def next(self):
        assert self.sock.poll(2000), "the front sent nothing"
        return self.dec.decode(self.sock.recv())


@pytest.fixture
def front(mimo_bundle):
    client = EngineCoreClient(LLMSettings(model_dir=str(mimo_bundle)), AutoTokenizer.from_pretrained(mimo_bundle))
    push = client._sync_ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind("inproc://front-inputs")
    wire = Wire(client._sync_ctx, "inproc://front-inputs")
    client._core = _Core(epoch=1, proc=None, inputs=push, outputs=None)  # no process: we play the core
    client.ready = True
    yield client, wire
    wire.sock.close(0)
    push.close(0)
    client._sync_ctx.term()
    client._async_ctx.term()


def prep(rid: str) -> PreparedRequest:
    return PreparedRequest(request_id=rid, prompt_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4))


async def drain(stream) -> list:
    outs = []
    async for out in stream:
        outs.append(out)
    return outs


def test_a_reused_id_is_not_ended_by_the_earlier_requests_abort(front):
    client, wire = front

    async def run():
        first = client.submit(prep("chatcmpl-1"))
        add1 = wire.next()
        assert isinstance(add1, CoreAdd)
        # the media fetch of the first failed: the front ends it and tells the core to abort
        client._fail_one(1, add1.request_id, "media gone", 409, MEDIA_UNAVAILABLE)
        abort1 = wire.next()
        assert isinstance(abort1, CoreAbort) and abort1.request_ids == [add1.request_id]
        [end1] = await drain(first)
        assert end1.error_status == 409
        # re-sent at once under the same client id, before the core applied that abort
        second = client.submit(prep("chatcmpl-1"))
        add2 = wire.next()
        assert isinstance(add2, CoreAdd)
        assert add2.request_id != add1.request_id  # the core's abort of add1 cannot hit it
        # a late output of the first request reaches the front: it must not end the second
        client._on_token(CoreToken(add1.request_id, finish_reason="abort"))
        client._on_token(CoreToken(add2.request_id, token_id=9))
        client._on_token(CoreToken(add2.request_id, token_id=9, finish_reason="length"))
        outs = await drain(second)
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 2
        assert client.num_in_flight == 0 and not client._core_ids and not client._refs
        # an abort by client id names the core's id of the live request
        third = client.submit(prep("chatcmpl-1"))
        add3 = wire.next()
        client.abort("chatcmpl-1")
        assert wire.next().request_ids == [add3.request_id]
        client._on_token(CoreToken(add3.request_id, finish_reason="abort"))
        assert (await drain(third))[-1].finish_reason == "abort"
        assert not client._core_ids

    asyncio.run(run())


def test_an_id_is_free_again_once_its_request_failed(front):
    """(A duplicate in flight is refused by the routes: test_llm_hardening.)"""
    client, wire = front

    async def run():
        client.submit(prep("dup"))
        assert client._core_ids
        client._fail_all("stopping", 503)
        assert not client._core_ids
        client.submit(prep("dup"))  # free again once failed
        assert list(client._core_ids) == ["dup"]

    asyncio.run(run())
