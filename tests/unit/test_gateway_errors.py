import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.errors import APIError, loc_to_param, validation_message
from gateway.openai_api.requests import ChatCompletionRequest
from gateway.upstream import UpstreamError, error_text

pytestmark = pytest.mark.unit


def errors_for(body: dict) -> RequestValidationError:
    try:
        ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        return RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()])
    raise AssertionError("expected a validation error")


def test_error_body_is_openai_shaped():
    e = APIError(404, "The model `x` does not exist", param="model", code="model_not_found")
    assert e.body() == {"error": {"message": "The model `x` does not exist", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}}
    r = e.response()
    assert r.status_code == 404 and json.loads(r.body) == e.body()


@pytest.mark.parametrize("status,type_", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (429, "rate_limit_error"), (500, "server_error"), (502, "server_error")])
def test_type_follows_status(status, type_):
    assert APIError(status, "m").type == type_


def test_401_has_www_authenticate():
    assert APIError(401, "no").response().headers["www-authenticate"] == "Bearer"


def test_upstream_error():
    e = UpstreamError("all down", status=503)
    assert e.status == 503 and e.body()["error"]["type"] == "upstream_error"


def test_loc_to_param_drops_union_branch_names():
    loc = ("body", "messages", 0, "content", "list[tagged-union[TextPart,ImagePart]]", 1, "image_url", "url")
    assert loc_to_param(loc) == "messages[0].content[1].image_url.url"
    assert loc_to_param(("body", "messages", 2, "content", "str")) == "messages[2].content"
    assert loc_to_param(("body",)) == ""


def test_unknown_part_type_names_the_part():
    exc = errors_for({"model": "m", "messages": [{"role": "user", "content": [{"type": "audio_url", "x": 1}]}]})
    msg, param = validation_message(exc)
    assert param == "messages[0].content[0].type"
    assert msg == ("messages[0].content[0].type: unknown content part type 'audio_url'; this server takes text, "
                   "image_url, video_url, input_audio parts")


def test_missing_field_and_error_count():
    msg, param = validation_message(errors_for({"messages": []}))
    assert "Field required" in msg or "at least 1" in msg
    assert "(and 1 more error)" in msg


def test_json_invalid_wins():
    exc = RequestValidationError([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                   "ctx": {"error": "Expecting value"}}])
    assert validation_message(exc) == ("request body is not valid JSON: Expecting value", None)


class _Resp:
    def __init__(self, body, status=400):
        self.text = body if isinstance(body, str) else json.dumps(body)
        self.status_code = status

    def json(self):
        return json.loads(self.text)


@pytest.mark.parametrize(
    "body,expected",
    [({"error": {"message": "prompt too long"}}, "prompt too long"), ({"detail": "bad image"}, "bad image"),
     ({"error": "nope"}, "nope"), ("plain text", "plain text"), ({"detail": [{"msg": "x"}]}, '[{"msg": "x"}]')],
)
def test_error_text_extracts_upstream_message(body, expected):
    assert error_text(_Resp(body)) == expected
