"""The attacks of ``benchmarks.security_load`` (issue 42), one registry entry each: what is sent,
to which service, and the status codes that count as refused. ``send`` returns the status code
(0: no answer within the attack's timeout, which is a failure)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

# a nested loop: 10^10 iterations of the template engine, hours of one CPU if it were rendered
NESTED_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
BIG_BODY = 200 * 1024 * 1024


@dataclass
class AttackContext:
    gateway: str
    llm: str
    encoder: str
    model: str
    api_key: str
    service_token: str
    redis_url: str | None
    work: Path
    media: dict[str, bytes] = field(default_factory=dict)
    # the attacker process's one client (set by ``security_load``'s attacker): a client per send
    # builds an SSL context each time, ~10-20 ms of the attacker's CPU, which on this 2-core
    # machine is taken from the services under test, not spent by them
    client: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    @staticmethod
    def redis_if_up() -> str | None:
        """Redis on 127.0.0.1:6379 (db 11, the benchmark's own) if it answers, else None."""
        try:
            import redis

            redis.Redis(host="127.0.0.1", port=6379, socket_timeout=1).ping()
        except Exception:
            return None
        return "redis://127.0.0.1:6379/11"

    def prepare(self, names: list[str]) -> None:
        """Build the media the chosen attacks send (before the clock starts)."""
        for name in names:
            prep = ATTACKS[name].prepare
            if prep is not None:
                prep(self)

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


@dataclass(frozen=True)
class Attack:
    send: Callable[[AttackContext], Awaitable[int]]
    expected: frozenset[int]
    what: str
    prepare: Callable[[AttackContext], None] | None = None
    slow: bool = False  # its refusal takes seconds by design (a timeout): sent once per run in --quick


async def _post(ctx: AttackContext, url: str, path: str, body: dict, headers: dict, timeout: float = 120.0) -> int:
    try:
        if ctx.client is not None:
            return (await ctx.client.post(url + path, json=body, headers=headers, timeout=timeout)).status_code
        async with httpx.AsyncClient(timeout=timeout) as c:
            return (await c.post(url + path, json=body, headers=headers)).status_code
    except httpx.HTTPError:
        return 0


async def _big_body(url: str, path: str, headers: dict[str, str], timeout: float = 30.0) -> int:
    """Declare a ``BIG_BODY`` JSON body, send its first MiB, then read the answer: a server that
    waits for the rest (or parses it) before answering never answers in time (0)."""
    u = urlsplit(url)
    try:
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
    except OSError:
        return 0
    try:
        head = [f"POST {path} HTTP/1.1", f"Host: {u.netloc}", "Content-Type: application/json",
                f"Content-Length: {BIG_BODY}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        writer.write("\r\n".join(head).encode() + b'{"messages": "' + b"A" * (1 << 20))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


def _chat(ctx: AttackContext, **extra) -> dict:
    return {"model": ctx.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


def _media_chat(ctx: AttackContext, part: dict) -> dict:
    return {"model": ctx.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}


def _ffmpeg(args: list[str]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / ("out" + Path(args[-1]).suffix)
        subprocess.run(["ffmpeg", "-v", "error", "-y", *args[:-1], str(out)], check=True)
        return out.read_bytes()


# ---- attacks -----------------------------------------------------------------------------------
async def template_tokenize(ctx: AttackContext) -> int:
    return await _post(ctx, ctx.gateway, "/tokenize",
                       {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}],
                        "chat_template_kwargs": {"chat_template": NESTED_TEMPLATE}}, ctx.auth)


async def template_chat(ctx: AttackContext) -> int:
    return await _post(ctx, ctx.gateway, "/v1/chat/completions",
                       _chat(ctx, chat_template_kwargs={"chat_template": NESTED_TEMPLATE}), ctx.auth)


async def template_llm_tokenize(ctx: AttackContext) -> int:
    """Straight at the LLM front (a caller holding the service token)."""
    return await _post(ctx, ctx.llm, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                              "chat_template_kwargs": {"chat_template": NESTED_TEMPLATE}},
                       {"x-mmserve-service-token": ctx.service_token})


async def body_no_key(ctx: AttackContext) -> int:
    return await _big_body(ctx.gateway, "/v1/chat/completions", {})


async def body_too_big(ctx: AttackContext) -> int:
    return await _big_body(ctx.gateway, "/v1/completions", ctx.auth)


async def completions_10k(ctx: AttackContext) -> int:
    return await _post(ctx, ctx.gateway, "/v1/completions",
                       {"model": ctx.model, "max_tokens": 4, "prompt": [f"prompt {i}" for i in range(10_000)]},
                       ctx.auth)


def _prep_flac(ctx: AttackContext) -> None:
    # 1 s of an 8-channel tone at 655,340 Hz (ffmpeg refuses 768 kHz FLAC; this is its highest): ~5.2 M samples
    ctx.media["flac"] = _ffmpeg(["-f", "lavfi", "-i", "sine=frequency=300:duration=1:sample_rate=655340",
                                 "-ac", "8", "-c:a", "flac", "-compression_level", "0", "bomb.flac"])


async def audio_samples(ctx: AttackContext) -> int:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(ctx.media["flac"]).decode(),
                                                   "format": "flac"}}
    return await _post(ctx, ctx.gateway, "/v1/chat/completions", _media_chat(ctx, part), ctx.auth)


def _prep_video(ctx: AttackContext) -> None:
    # 8K frames (33 MP each: under the per-frame max_image_pixels), 10 s at 1 fps: the 10 sampled
    # frames are 332 M pixels, past the encoder's per-item max_video_pixels (265 M)
    ctx.media["video"] = _ffmpeg(["-f", "lavfi", "-i", "color=c=blue:s=7680x4320:r=1:d=10", "-c:v", "libx264",
                                  "-preset", "ultrafast", "-crf", "51", "-pix_fmt", "yuv420p", "big.mp4"])


async def video_pixels(ctx: AttackContext) -> int:
    url = "data:video/mp4;base64," + base64.b64encode(ctx.media["video"]).decode()
    return await _post(ctx, ctx.gateway, "/v1/chat/completions", _media_chat(ctx, {"type": "video_url",
                                                                              "video_url": {"url": url}}), ctx.auth)


async def outside_source(ctx: AttackContext) -> int:
    """A /v1/generate (with the service token) whose media item is fetched from a host that is
    not one of the LLM's encoders: refused, the token never sent there."""
    from shared.rawwire import SAFETENSORS_MIME, pack_raw
    from shared.schemas import GenerateRequest, PromptMedia, PromptMessage, PromptText

    gen = GenerateRequest(request_id=f"outside-{id(ctx)}-{asyncio.get_running_loop().time()}", messages=[
        PromptMessage(role="user", content=[PromptText(text="hi"), PromptMedia(
            modality="image", index=0, content_hash="h", num_tokens=16, key="k",
            sources=["http://203.0.113.7:8100"])])])
    headers = {"x-mmserve-service-token": ctx.service_token, "content-type": SAFETENSORS_MIME}
    try:
        if ctx.client is not None:
            return (await ctx.client.post(ctx.llm + "/v1/generate", content=pack_raw({}, gen), headers=headers,
                                          timeout=60)).status_code
        async with httpx.AsyncClient(timeout=60) as c:
            return (await c.post(ctx.llm + "/v1/generate", content=pack_raw({}, gen), headers=headers)).status_code
    except httpx.HTTPError:
        return 0


async def hostile_schema(ctx: AttackContext) -> int:
    """A JSON schema whose grammar compiles for minutes (four strings of ``(a|b){16000}``: 140 CPU-s
    unbounded on a 2-core Xeon); each send a new count, so none is refused from the timed-out cache."""
    count = random.randint(14000, 16000)
    schema = {"type": "object", "required": ["p0", "p1", "p2", "p3"], "properties": {
        f"p{i}": {"type": "string", "pattern": f"({a}|{b}){{{count}}}"}
        for i, (a, b) in enumerate(["ab", "cd", "ef", "gh"])}}
    fmt = {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}
    return await _post(ctx, ctx.gateway, "/v1/chat/completions", _chat(ctx, response_format=fmt), ctx.auth, timeout=300)


ATTACKS: dict[str, Attack] = {
    "template_tokenize": Attack(template_tokenize, frozenset({400}), "nested-loop Jinja on the gateway's /tokenize"),
    "template_chat": Attack(template_chat, frozenset({400}), "nested-loop Jinja in a chat's chat_template_kwargs"),
    "template_llm_tokenize": Attack(template_llm_tokenize, frozenset({400}),
                                    "nested-loop Jinja on the LLM front's /tokenize"),
    "body_no_key": Attack(body_no_key, frozenset({401}), "200 MB chat body without an API key"),
    "body_too_big": Attack(body_too_big, frozenset({413}), "200 MB completions body with a key"),
    "completions_10k": Attack(completions_10k, frozenset({400}), "10,000 prompts in one /v1/completions"),
    "audio_samples": Attack(audio_samples, frozenset({400, 413}),
                            "1 s 655 kHz 8-channel FLAC (ffmpeg writes no 768 kHz FLAC)", prepare=_prep_flac),
    "video_pixels": Attack(video_pixels, frozenset({400, 413}), "10 s of 8K frames (per-frame ok, per-item not)",
                           prepare=_prep_video),
    "hostile_schema": Attack(hostile_schema, frozenset({400}), "a JSON schema that compiles for minutes",
                             slow=True),
    "outside_source": Attack(outside_source, frozenset({400}), "/v1/generate naming an outside media source"),
}
