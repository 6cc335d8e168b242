"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app


@pytest.fixture(scope="module")
def upstreams():
    """A fake encoder and a fake LLM service over real HTTP, for a gateway in front of them:
    ``(encoder, llm)`` servers, each recording what it was sent."""
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    yield enc, llm
    enc.stop()
    llm.stop()
