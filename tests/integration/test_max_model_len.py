"""``max_model_len`` unset is the checkpoint's context length (8192 for the tiny MiMo, as vLLM
reads ``max_position_embeddings``), at most what the swa engine's KV pool holds; a setting wins."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shared.schemas import GenerateRequest, HealthStatus, SamplingParams
from shared.settings import LLMSettings
from shared.wire import SAFETENSORS_MIME, pack

pytestmark = pytest.mark.integration


def served_limits(settings: LLMSettings, past_pool: list | None = None) -> tuple[int, int, int | None]:
    """(/readyz's max_model_len, /tokenize's, the KV pool's full slots) of a service started in-process;
    ``past_pool``: gets the answers to a request one token past the pool, plain and streamed."""
    from llm_svc.front.app import create_app

    app = create_app(settings)

    async def go():
        state = app.state.svc
        await state.load()
        assert state.ready, state.error
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                ready = HealthStatus.model_validate((await c.get("/readyz")).json())
                tok = (await c.post("/tokenize", json={"prompt": "hi"})).json()
                held = state.backend.max_sequence_tokens()
                for stream in (False, True) if past_pool is not None else ():
                    req = GenerateRequest(request_id=f"past-{stream}", prompt_ids=[100] * (held - 3), stream=stream,
                                          sampling=SamplingParams(max_tokens=4))
                    r = await c.post("/v1/generate", content=pack({}, req), headers={"content-type": SAFETENSORS_MIME})
                    past_pool.append((r.status_code, r.json()["error"]))
            return ready.limits.max_model_len, tok["max_model_len"], held
        finally:
            await state.close()

    return asyncio.run(go())


def test_unset_is_the_checkpoints_context_length(mimo_bundle):
    assert served_limits(LLMSettings(model_dir=str(mimo_bundle), backend="hf")) == (8192, 8192, None)


def test_a_setting_wins_even_past_the_checkpoints(mimo_bundle):
    settings = LLMSettings(model_dir=str(mimo_bundle), backend="hf", max_model_len=20000)
    assert served_limits(settings)[:2] == (20000, 20000)


def test_unset_is_at_most_what_the_kv_pool_holds(mimo_bundle):
    small = dict(model_dir=str(mimo_bundle), backend="swa", kv_bytes=10 << 20)  # about 5,500 full slots
    ready, tokenize, held = served_limits(LLMSettings(**small))
    assert held is not None and held < 8192 and ready == tokenize == held
    # set, it stays: a request past the pool is still refused by the pool's own check, streamed or not
    answers = []
    ready, _, held = served_limits(LLMSettings(**small, max_model_len=8192), answers)
    assert ready == 8192 and held < 8192 and len(answers) == 2
    for status, err in answers:
        assert status == 400 and err["code"] == "context_length_exceeded", err
        assert f"needs {held + 1} KV slots" in err["message"] and f"holds {held}" in err["message"], err
