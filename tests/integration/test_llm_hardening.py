"""The LLM service's front under bad input and vanishing clients (issue 11), hf backend in-process."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from shared.schemas import GenerateRequest, HealthStatus, PromptMessage, PromptText, SamplingParams
from shared.settings import LLMSettings
from shared.wire import SAFETENSORS_MIME, pack

pytestmark = pytest.mark.integration


def request(rid: str, stream: bool, max_tokens: int = 200, **sampling) -> bytes:
    req = GenerateRequest(request_id=rid, stream=stream, sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                          messages=[PromptMessage(role="user", content=[PromptText(text="hello there")])])
    return pack({}, req)


def scope(body: bytes, spec: str = "2.4") -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/generate", "raw_path": b"/v1/generate",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", SAFETENSORS_MIME.encode()), (b"content-length", str(len(body)).encode())],
    }


@contextlib.asynccontextmanager
async def served(app):
    """``app``'s state loaded on this event loop, and a client over ASGI; closed after."""
    state = app.state.svc
    await state.load()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            yield state, c
    finally:
        await state.close()


@pytest.fixture(scope="module")
def service(mimo_bundle):
    """The app with its state loaded in this test's event loop (no server: ASGI calls)."""
    from llm_svc.front.app import create_app

    settings = LLMSettings(model_dir=str(mimo_bundle), backend="hf", max_model_len=512, max_request_bytes=64 * 1024)
    return create_app(settings)


def test_stream_is_aborted_when_the_client_is_gone_before_the_first_byte(service):
    state = service.state.svc

    async def go() -> None:
        await state.load()
        assert state.ready, state.error
        try:
            for spec in ("2.4", "2.3"):  # send fails / the disconnect listener wins
                body = request(f"gone-{spec}", stream=True)
                delivered = False

                async def receive():
                    nonlocal delivered
                    if not delivered:
                        delivered = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    return {"type": "http.disconnect"}

                async def send(message):
                    if message["type"] == "http.response.start":
                        if spec == "2.4":
                            raise OSError("client went away")
                        await asyncio.sleep(0.5)  # the disconnect is seen meanwhile

                try:
                    await service(scope(body, spec), receive, send)
                except Exception:  # noqa: BLE001 - starlette re-raises the disconnect
                    pass
                for _ in range(600):  # the abort drains the stream, then the id is released
                    if not state.in_flight:
                        break
                    await asyncio.sleep(0.05)
                assert state.in_flight == set(), spec
                assert state.backend.stats().running == 0
        finally:
            await state.close()

    asyncio.run(go())


def test_body_over_the_limit_is_a_413_and_readyz_reports_limits(mimo_bundle):
    from llm_svc.front.app import create_app

    app = create_app(LLMSettings(model_dir=str(mimo_bundle), backend="hf", max_model_len=512,
                                 max_request_bytes=64 * 1024))

    async def go() -> None:
        state = app.state.svc
        await state.load()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                ready = HealthStatus.model_validate((await c.get("/readyz")).json())
                assert ready.limits is not None and ready.limits.max_model_len == 512
                assert ready.limits.max_token_bytes == state.lm.max_token_bytes >= 1
                big = pack({}, GenerateRequest(request_id="big", messages=[
                    PromptMessage(role="user", content=[PromptText(text="x" * 100_000)])]))
                r = await c.post("/v1/generate", content=big, headers={"content-type": SAFETENSORS_MIME})
                assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

                async def chunked():  # no content-length: counted while it arrives
                    for i in range(0, len(big), 8192):
                        yield big[i : i + 8192]

                r = await c.post("/v1/generate", content=chunked(), headers={"content-type": SAFETENSORS_MIME})
                assert r.status_code == 413
                # a seed past 2**64 with sampling is served (reduced into the generator's range)
                r = await c.post("/v1/generate", content=request("seed", False, 4, temperature=1.0, seed=2**70),
                                 headers={"content-type": SAFETENSORS_MIME})
                assert r.status_code == 200, r.text
        finally:
            await state.close()

    asyncio.run(go())


def test_deadline_stops_generation_and_admission_bound_is_a_429(mimo_bundle):
    from llm_svc.front.app import create_app

    app = create_app(LLMSettings(model_dir=str(mimo_bundle), backend="hf", max_model_len=512, max_in_flight=1))
    headers = {"content-type": SAFETENSORS_MIME}

    async def go() -> None:
        async with served(app) as (state, c):
            body = request("late", False, max_tokens=400, ignore_eos=True)
            r = await c.post("/v1/generate", content=body, headers={**headers, "x-mmserve-deadline-ms": "0"})
            assert r.status_code == 504  # dead on arrival: never started
            t0 = asyncio.get_running_loop().time()
            r = await c.post("/v1/generate", content=request("slow", False, max_tokens=400, ignore_eos=True),
                             headers={**headers, "x-mmserve-deadline-ms": "300"})
            assert r.status_code == 504 and "deadline" in r.json()["error"]["message"], r.text
            assert asyncio.get_running_loop().time() - t0 < 20
            # one in flight (max_in_flight=1): a second request is refused at once
            first = asyncio.create_task(c.post("/v1/generate", headers=headers,
                                               content=request("busy", False, max_tokens=300, ignore_eos=True)))
            while state.admission.in_flight == 0:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/generate", content=request("second", False, 2), headers=headers)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert (await first).status_code == 200
            assert state.admission.in_flight == 0 and state.live == {} and state.in_flight == set()
            state.admission.check_integrity()
            text = (await c.get("/metrics")).text
            assert "mmserve_llm_deadline_drops_total 2.0" in text

    asyncio.run(go())


def test_a_request_id_in_flight_is_refused_and_free_again_once_it_ended(mimo_bundle):
    """The front's one check of duplicate ids (the engine core keys requests by ids of its own)."""
    from llm_svc.front.app import create_app

    app = create_app(LLMSettings(model_dir=str(mimo_bundle), backend="hf", max_model_len=512))
    headers = {"content-type": SAFETENSORS_MIME}

    async def go() -> None:
        async with served(app) as (state, c):
            first = asyncio.create_task(c.post("/v1/generate", headers=headers,
                                               content=request("dup", False, max_tokens=300, ignore_eos=True)))
            while "dup" not in state.in_flight:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/generate", content=request("dup", False, 2), headers=headers)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "already in flight" in err["message"] and err["param"] == "request_id"
            assert (await first).status_code == 200
            assert state.in_flight == set()
            r = await c.post("/v1/generate", content=request("dup", False, 2), headers=headers)
            assert r.status_code == 200, r.text  # free again once it ended

    asyncio.run(go())
