"""The whole local stack (gateway + encoder + LLM as processes), started once per module."""

from __future__ import annotations

import pytest

from mmserve.launcher import LocalStack, StackSpec


@pytest.fixture(scope="module")
def stack(mimo_bundle, tmp_path_factory):
    spec = StackSpec(model_dir=str(mimo_bundle), gateway_port=0)  # default backend: swa
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("stack-logs")) as s:
        s.wait_ready(timeout=240)
        yield s


def stream_chat(client, model: str, messages: list[dict], max_tokens: int):
    """Greedy streamed chat with the openai client: (text, finish_reason, usage)."""
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    return "".join(pieces), finish, usage
