"""``max_model_len`` unset is the checkpoint's context length (8192 for the tiny MiMo, as vLLM
reads ``max_position_embeddings``), at most what the swa engine's KV pool holds; a setting wins."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shared.schemas import HealthStatus
from shared.settings import LLMSettings

pytestmark = pytest.mark.integration


def served_limits(settings: LLMSettings) -> tuple[int, int, int | None]:
    """(/readyz's max_model_len, /tokenize's, the KV pool's full slots) of a service started in-process."""
    from llm_svc.app import create_app

    app = create_app(settings)

    async def go():
        state = app.state.svc
        await state.load()
        assert state.ready, state.error
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                ready = HealthStatus.model_validate((await c.get("/readyz")).json())
                tok = (await c.post("/tokenize", json={"prompt": "hi"})).json()
            return ready.limits.max_model_len, tok["max_model_len"], state.backend.max_sequence_tokens()
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
    # set, it stays: a request past the pool is still refused by the pool's own check
    ready, _, held = served_limits(LLMSettings(**small, max_model_len=8192))
    assert ready == 8192 and held < 8192
