"""Test helpers: uvicorn-in-a-thread on a free loopback port, and fake encoder / LLM services
with known answers (used by the gateway's integration tests and handy for local experiments).

* fake encoder: ``embeds`` is ``[len(body) % 5 + 1, hidden]`` float32 filled with ``len(body)``;
  images that PIL cannot open, and bodies starting with ``b"BAD"``, get a 400; ``by_ref=true``
  keeps them in ``app.state.store`` (served by ``GET /v1/embeddings/{key}``) and answers JSON.
* fake LLM: the generated text is a JSON summary of what it received (messages with media
  placeholders and the fill value of each ``mm.i`` tensor, sampling, replica name); items sent
  by reference are fetched from their sources, and one that none serves is a 409
  ``media_unavailable``, as the real LLM answers.

No torch here: like the gateway, these handle tensors as raw safetensors bytes."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import struct
import threading
import time
from urllib.parse import quote

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shared.schemas import (
    EncodeResult,
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    PromptMedia,
)
from shared.rawwire import SAFETENSORS_MIME, RawTensor, pack_raw, unpack_raw


class ServerThread:
    """Serves an ASGI app with uvicorn in a daemon thread; ``url`` is ``http://127.0.0.1:<port>``."""

    def __init__(self, app, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 20.0) -> "ServerThread":
        """Starts the thread (once) and waits until uvicorn listens."""
        if not self.thread.is_alive() and not self.server.started:
            self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port_url() -> str:
    """A loopback URL where nothing listens (port bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def filled(rows: int, hidden: int, value: float) -> RawTensor:
    """A float32 ``[rows, hidden]`` tensor of ``value`` as raw bytes."""
    return RawTensor("F32", (rows, hidden), struct.pack(f"<{rows * hidden}f", *([value] * (rows * hidden))))


def first_value(t: RawTensor) -> float:
    assert t.dtype == "F32", t.dtype
    return struct.unpack_from("<f", t.data)[0]


def fake_encoder_app(name: str, hidden: int = 8) -> FastAPI:
    """``app.state.calls`` lists ``(modality, content_hash, len(body))``; set ``app.state.ready``
    / ``app.state.fail_5xx`` to make it unready or failing (with ``app.state.fail_status``);
    ``app.state.store`` (key -> tensor) holds what was encoded by reference (clear it to evict),
    ``app.state.keep_refs = False`` makes it answer by value even when asked by reference."""
    app = FastAPI()
    app.state.calls = []
    app.state.ready = True
    app.state.fail_5xx = False
    app.state.fail_status = 500
    app.state.store = {}
    app.state.keep_refs = True
    app.state.gets = []  # keys asked for by GET /v1/embeddings

    @app.get("/v1/embeddings/{key:path}")
    async def embeddings(key: str) -> Response:
        app.state.gets.append(key)
        t = app.state.store.get(key)
        if t is None:
            return JSONResponse({"error": {"message": f"no cached embedding for key {key!r}"}}, status_code=404)
        modality = key.split(":")[1]
        result = EncodeResult(modality=modality, content_hash=key.rsplit(":", 1)[1], model=name,
                              num_tokens=t.shape[0], hidden_size=t.shape[1], cached=True, key=key)
        return Response(pack_raw({"embeds": t}, result), media_type=SAFETENSORS_MIME)

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(status_code=200 if app.state.ready else 503)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "service": "encoder"}

    @app.post("/v1/encode")
    async def encode(request: Request, modality: str, content_hash: str | None = None, by_ref: bool = False) -> Response:
        body = await request.body()
        app.state.calls.append((modality, content_hash, len(body)))
        if app.state.fail_5xx:
            return JSONResponse({"detail": "boom"}, status_code=app.state.fail_status)
        if body.startswith(b"BAD"):
            return JSONResponse({"detail": "bad media"}, status_code=400)
        if modality == "image":
            from PIL import Image

            try:
                Image.open(io.BytesIO(body)).verify()
            except Exception as e:
                return JSONResponse({"detail": f"cannot decode image: {e}"}, status_code=400)
        n = len(body) % 5 + 1
        embeds = filled(n, hidden, float(len(body)))  # [num_tokens, hidden]
        result = EncodeResult(
            modality=modality, content_hash=content_hash or "", model=name, num_tokens=n, hidden_size=hidden,
            key=f"{name}-model:{modality}:sig:{content_hash}",
        )
        if by_ref and app.state.keep_refs:
            app.state.store[result.key] = embeds
            return JSONResponse(result.model_copy(update={"by_ref": True}).model_dump())
        return Response(pack_raw({"embeds": embeds}, result), media_type=SAFETENSORS_MIME)

    return app


async def fetch_refs(req: GenerateRequest, tensors: dict[str, RawTensor]) -> list[int] | None:
    """Fills ``tensors`` with the items sent by reference, fetched from their sources as the real
    LLM does; returns the indices fetched, or None when one of them is nowhere to be found."""
    fetched = []
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for p in req.media():
            if f"mm.{p.index}" in tensors or not p.sources:
                continue
            for src in p.sources:
                try:
                    r = await client.get(f"{src}/v1/embeddings/{quote(p.key, safe=':')}")
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    tensors[f"mm.{p.index}"] = unpack_raw(r.content, EncodeResult)[0]["embeds"]
                    fetched.append(p.index)
                    break
            else:
                return None
    return fetched


def echo_summary(req: GenerateRequest, tensors: dict[str, RawTensor], replica: str, by_ref: set[int] = frozenset()) -> dict:
    msgs = []
    for m in req.messages:
        parts = []
        for p in m.content:
            if isinstance(p, PromptMedia):
                t = tensors[f"mm.{p.index}"]
                parts.append({
                    "media": p.modality, "index": p.index, "hash": p.content_hash, "key": p.key,
                    "num_tokens": p.num_tokens, "rows": t.shape[0], "fill": first_value(t),
                    "by_ref": p.index in by_ref,
                })
            else:
                parts.append({"text": p.text})
        msgs.append({"role": m.role, "parts": parts})
    return {"replica": replica, "messages": msgs, "sampling": req.sampling.model_dump()}


def fake_llm_app(name: str) -> FastAPI:
    """Echoes a JSON summary of the request as its text.  Prompt text containing ``TOO_LONG``
    gets a 400; ``FAIL_MID`` streams one chunk then an error chunk; ``NO_FINISH`` ends the stream
    without a finish chunk; ``ABORT`` finishes with ``finish_reason="abort"``; ``SLOW`` answers slowly
    (stream or not) and sets ``app.state.aborted`` when the caller goes away."""
    app = FastAPI()
    app.state.requests = []
    app.state.aborted = asyncio.Event()
    app.state.ready = True
    app.state.fail_5xx = False
    app.state.fail_status = 503
    app.state.limits = None  # a dict of ServiceLimits fields to report on /readyz
    app.state.headers = []  # the headers of each /v1/generate call
    app.state.body_bytes = []  # the size of each /v1/generate body

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:  # one token per UTF-8 byte of the prompt
        body = await request.json()
        text = body.get("prompt") or " ".join(str(m.get("content")) for m in body.get("messages") or [])
        ids = list(text.encode("utf-8"))
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        ids = (await request.json()).get("tokens") or []
        return JSONResponse({"prompt": bytes(t % 256 for t in ids).decode("utf-8", "replace")})

    @app.get("/readyz")
    async def readyz() -> Response:
        if not app.state.ready:
            return Response(status_code=503)
        return JSONResponse({"status": "ok", "service": "llm", "model": name, "limits": app.state.limits})

    @app.post("/v1/generate")
    async def generate(request: Request) -> Response:
        body = await request.body()
        tensors, req = unpack_raw(body, GenerateRequest)
        app.state.requests.append(req)
        app.state.headers.append(dict(request.headers))
        app.state.body_bytes.append(len(body))
        if app.state.fail_5xx:
            headers = {"retry-after": "3"} if app.state.fail_status == 429 else None
            return JSONResponse({"detail": "engine down"}, status_code=app.state.fail_status, headers=headers)
        prompt = " ".join(p.text for m in req.messages for p in m.content if not isinstance(p, PromptMedia))
        if "TOO_LONG" in prompt:
            return JSONResponse({"error": {"message": "prompt is too long: 9999 > 4096 tokens"}}, status_code=400)
        fetched = await fetch_refs(req, tensors)
        if fetched is None:
            err = {"message": "media sent by reference is no longer available; re-send it by value",
                   "code": "media_unavailable"}
            return JSONResponse({"error": err}, status_code=409)
        text = json.dumps(echo_summary(req, tensors, name, set(fetched)))
        media_tokens = sum(p.num_tokens for p in req.media())
        counts = {"prompt_tokens": media_tokens + len(prompt.split()), "completion_tokens": 7, "cached_tokens": 3}
        finish = "abort" if "ABORT" in prompt else "stop"
        if not req.stream:
            if "SLOW" in prompt:  # answers after 10 s unless the caller hangs up first
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    if await request.is_disconnected():
                        app.state.aborted.set()
                        return Response(status_code=499)
            return JSONResponse(
                GenerateResponse(request_id=req.request_id, text=text, token_ids=[], finish_reason=finish, **counts).model_dump()
            )

        async def lines():
            pieces = [text[i : i + 16] for i in range(0, len(text), 16)]
            try:
                for k, piece in enumerate(pieces):
                    if "SLOW" in prompt:
                        await asyncio.sleep(0.4)
                    yield GenerateChunk(request_id=req.request_id, text=piece).model_dump_json() + "\n"
                    if "FAIL_MID" in prompt:
                        yield GenerateChunk(request_id=req.request_id, error="engine exploded").model_dump_json() + "\n"
                        return
                if "NO_FINISH" not in prompt:
                    yield GenerateChunk(request_id=req.request_id, finish_reason=finish, **counts).model_dump_json() + "\n"
            except asyncio.CancelledError:
                app.state.aborted.set()
                raise

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def media_server_app() -> FastAPI:
    """Serves ``app.state.files[name]`` at ``/files/{name}`` and redirects ``/redirect?to=URL``."""
    app = FastAPI()
    app.state.files = {}

    @app.get("/files/{name}")
    async def files(name: str) -> Response:
        if name not in app.state.files:
            return Response(status_code=404)
        return Response(app.state.files[name], media_type="application/octet-stream")

    @app.get("/redirect")
    async def redirect(to: str) -> Response:
        return Response(status_code=302, headers={"location": to})

    return app
