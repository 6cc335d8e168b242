"""``POST /v1/responses`` (OpenAI's Responses API, the Agents SDK's default), stateless: the
request becomes a chat request (``gateway.openai_api.responses_format``) and runs the chat
pipeline (``gateway.pipeline.chat``), media, tools, structured output and streaming included."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from gateway.edge.auth import ApiKeyDep
from gateway.errors import APIError
from gateway.openai_api.answer_format import completion_id, now
from gateway.openai_api.responses_api import ResponsesRequest
from gateway.openai_api.responses_format import (InputError, ResponsesEventWriter, ResponseShell, response_object,
                                                 to_chat)
from gateway.openai_api.validate import check_model
from gateway.pipeline import chat
from gateway.state import StateDep
from shared.schemas import GenerateResponse

router = APIRouter(dependencies=[ApiKeyDep])


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: StateDep) -> Response:
    check_model(body.model, state.model_name)
    try:
        as_chat = to_chat(body)
    except InputError as e:
        raise APIError(400, str(e), param=e.param) from None
    except (TypeError, AttributeError):  # an item's field of the wrong JSON type
        raise APIError(400, "input: an item has a field of the wrong type (see the Responses API's input items)",
                       param="input") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where}: {err.get('msg', 'invalid')}".strip(": "), param="input") from None
    chat.validate(state, as_chat, format_param="text.format")
    cid, start = completion_id("chatcmpl"), time.monotonic()
    shell = ResponseShell(body, now())

    def shape(resps: list[GenerateResponse]) -> dict:
        return response_object(shell, resps[0])

    return await chat.run(request, state, as_chat, cid, start, shape, ResponsesEventWriter(shell))
