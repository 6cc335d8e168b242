"""Reading a server-sent-event stream from our OpenAI-compatible endpoints in tests."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


def sse_events(r: httpx.Response) -> Iterator[dict]:
    """Each ``data:`` event's JSON up to ``[DONE]``; an error event fails the test."""
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            yield ev
