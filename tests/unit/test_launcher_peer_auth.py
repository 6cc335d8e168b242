"""``mmserve up`` (LocalStack) wires peer authentication: with a Redis, every service gets the same
peer key, fresh per stack unless MMSERVE_PEER_KEY names one; the LLMs may fetch media from the
stack's encoders (host:port each), no other port of the host."""

from __future__ import annotations

import pytest

from mmserve.launcher import PEER_KEY_VARS, LocalStack, StackSpec

pytestmark = pytest.mark.unit


def stack(tmp_path, monkeypatch, **kw) -> LocalStack:
    for v in ("MMSERVE_PEER_KEY", *PEER_KEY_VARS):
        monkeypatch.delenv(v, raising=False)
    return LocalStack(StackSpec(model_dir=str(tmp_path), gateway_port=0, **kw), log_dir=tmp_path / "logs")


def keys(s: LocalStack) -> set[str]:
    return {svc.env.get(v) for svc in s.services for v in PEER_KEY_VARS
            if v.split("_")[1].lower() == svc.name.split("-")[0]}


def test_every_service_gets_one_peer_key_per_stack(tmp_path, monkeypatch):
    a = stack(tmp_path, monkeypatch, encoders=2, llms=2, redis_url="redis://127.0.0.1:6379/0")
    [key] = keys(a)
    assert key and len(key) == 64 and len(a.services) == 5
    b = stack(tmp_path, monkeypatch, redis_url="redis://127.0.0.1:6379/0")
    assert keys(b) != {key}  # a stack of its own: its own key
    monkeypatch.setenv("MMSERVE_PEER_KEY", "k" * 40)
    c = LocalStack(StackSpec(model_dir=str(tmp_path), gateway_port=0, redis_url="redis://127.0.0.1:6379/0"),
                   log_dir=tmp_path / "logs")
    assert keys(c) == {"k" * 40}
    assert keys(stack(tmp_path, monkeypatch)) == {None}  # no Redis: nothing read back, no key


def test_llms_fetch_from_the_stacks_encoders_only(tmp_path, monkeypatch):
    s = stack(tmp_path, monkeypatch, encoders=2)
    allow = {svc.env["MMSERVE_LLM_MEDIA_FETCH_ALLOW"] for svc in s.llms}
    assert allow == {",".join(e.url.removeprefix("http://") for e in s.encoders)}
    assert all(":" in entry for entry in next(iter(allow)).split(","))
