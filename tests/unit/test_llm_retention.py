"""SWA retention points chosen by the service (``llm_svc.kv.retention``) and the system message's
end as the chat template renders it."""

from __future__ import annotations

import pytest

from llm_svc.front.prompt import render_prompt_ids, system_prefix_len
from llm_svc.kv.retention import retention_points
from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams

pytestmark = pytest.mark.unit


def test_points_system_end_and_every_k_for_short_prompts():
    assert retention_points(5000, 300, 1024, 8192) == [300, 1024, 2048, 3072, 4096]
    assert retention_points(20000, 300, 1024, 8192) == [300]  # long: only the branch point
    assert retention_points(2048, 0, 1024, 8192) == [1024]  # never the prompt's own end
    assert retention_points(900, 900, 0, 8192) == []


def test_system_prefix_len_is_where_the_system_message_ends(mimo16):
    lm = mimo16

    def req(system: str, user: str) -> GenerateRequest:
        return GenerateRequest(request_id="x", sampling=SamplingParams(), messages=[
            PromptMessage(role="system", content=[PromptText(text=system)]),
            PromptMessage(role="user", content=[PromptText(text=user)])])

    a, b = req("shared rules " * 10, "first question"), req("shared rules " * 10, "another one entirely")
    ia, ib = render_prompt_ids(lm, a), render_prompt_ids(lm, b)
    na, nb = system_prefix_len(lm, a, ia), system_prefix_len(lm, b, ib)
    assert na == nb > 10
    assert ia[:na] == ib[:na]  # the two conversations share exactly that head
    no_system = GenerateRequest(request_id="y", sampling=SamplingParams(),
                                messages=[PromptMessage(role="user", content=[PromptText(text="hi")])])
    assert system_prefix_len(lm, no_system, render_prompt_ids(lm, no_system)) == 0
