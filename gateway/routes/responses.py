"""``POST /v1/responses`` (OpenAI's Responses API, the Agents SDK's default), stateless: the
request becomes a chat request (``gateway.openai_api.responses_format``) and runs the chat path, media,
tools, structured output and streaming included."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from gateway.edge.auth import ApiKeyDep
from gateway.errors import APIError
from gateway.openai_api.responses_api import ResponsesRequest
from gateway.openai_api.answer_format import completion_id, now
from gateway.openai_api.request_limits import check_chat_limits
from gateway.openai_api.responses_format import InputError, ResponsesEventWriter, ResponseShell, response_object, to_chat
from gateway.routes.chat import _generate, _open, answer
from gateway.state import StateDep
from gateway.openai_api.validate import check_model, check_template, check_text

router = APIRouter(dependencies=[ApiKeyDep])


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: StateDep) -> Response:
    check_model(body.model, state.model_name)
    try:
        chat = to_chat(body)
    except InputError as e:
        raise APIError(400, str(e), param=e.param) from None
    except (TypeError, AttributeError):  # an item's field of the wrong JSON type
        raise APIError(400, "input: an item has a field of the wrong type (see the Responses API's input items)",
                       param="input") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where}: {err.get('msg', 'invalid')}".strip(": "), param="input") from None
    check_text(chat)
    check_template(chat.chat_template_kwargs, state.settings.trust_request_chat_template)
    check_chat_limits(chat, state.settings, format_param="text.format")
    cid, start = completion_id("chatcmpl"), time.monotonic()
    shell = ResponseShell(body, now())

    async def plain() -> dict:
        return response_object(shell, (await _generate(state, chat, cid))[0])

    return await answer(request, state, cid, start, body.stream, plain, lambda: _open(state, chat, cid),
                        ResponsesEventWriter(shell))
