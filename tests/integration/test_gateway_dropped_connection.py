"""A pooled gateway -> upstream connection that the upstream drops as the next request goes out
(its keep-alive timer fired, or the connection was reset) is retried on the same replica: with
one LLM or one encoder there is no other replica to fail over to, and the request must not be a
502. Over real HTTP, through a TCP proxy that lets each connection carry one request only."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import httpx
import pytest

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings
from tests.integration.test_gateway_chat import image_part, png

pytestmark = pytest.mark.integration

MODEL = "tiny-test"


class OneRequestPerConnection:
    """A TCP proxy to ``target`` that forwards each connection's first request and its answer,
    then drops the connection when the client sends anything more (a second request on the
    kept-alive connection): closed (``mode="close"``) or reset (``mode="reset"``)."""

    def __init__(self, target_port: int, mode: str) -> None:
        self.target_port, self.mode = target_port, mode
        self.connections = 0
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _conn(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.target_port)
        answered = asyncio.Event()  # the upstream has started answering the first request

        async def down() -> None:
            while data := await ureader.read(65536):
                answered.set()
                cwriter.write(data)
                await cwriter.drain()

        pump = asyncio.create_task(down())
        try:
            while data := await creader.read(65536):
                if answered.is_set():  # the next request on this connection: drop it unanswered
                    self.dropped += 1
                    if self.mode == "reset":
                        sock = cwriter.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                uwriter.write(data)
                await uwriter.drain()
        finally:
            pump.cancel()
            uwriter.close()
            cwriter.close()

    def stop(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(params=["close", "reset"])
def mode(request) -> str:
    return request.param


def chat(url: str, content) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def _gateway(enc_url: str, llm_url: str, **kw) -> ServerThread:
    s = GatewaySettings(model_name=MODEL, encoder_urls=[enc_url], llm_urls=[llm_url], dns_interval=0,
                        health_interval=0, connect_timeout=2, **kw)
    return ServerThread(create_app(s)).start()


def test_the_only_llm_dropping_a_kept_alive_connection_is_retried_there(mode):
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    proxy = OneRequestPerConnection(llm.port, mode)
    gw = _gateway(enc.url, proxy.url)
    try:
        for i in range(4):  # each request after the first finds its pooled connection dropped
            r = chat(gw.url, f"hello {i}")
            assert r.status_code == 200, r.text
        assert proxy.dropped >= 3  # the path was taken: the pooled connection was dropped each time
        assert len(llm.server.config.app.state.requests) == 4  # one generation per request
    finally:
        gw.stop()
        proxy.stop()
        llm.stop()
        enc.stop()


def test_the_only_encoder_dropping_a_kept_alive_connection_is_retried_there(mode):
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    proxy = OneRequestPerConnection(enc.port, mode)
    gw = _gateway(proxy.url, llm.url, media_by_ref=False)
    try:
        for i in range(4):
            r = chat(gw.url, [image_part(png(color=(40 * i, 0, 0))), {"type": "text", "text": "hi"}])
            assert r.status_code == 200, r.text
        assert proxy.dropped >= 3
    finally:
        gw.stop()
        proxy.stop()
        llm.stop()
        enc.stop()


def test_a_replica_that_drops_every_attempt_is_still_a_502_not_a_loop():
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    gw = None
    with socket.socket() as dead:  # accepts, reads, and closes every connection unanswered
        dead.bind(("127.0.0.1", 0))
        dead.listen(16)
        stop = threading.Event()

        def serve() -> None:
            dead.settimeout(0.2)
            while not stop.is_set():
                try:
                    c, _ = dead.accept()
                except (TimeoutError, OSError):
                    continue
                c.recv(65536)
                c.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            gw = _gateway(enc.url, f"http://127.0.0.1:{dead.getsockname()[1]}")
            r = chat(gw.url, "hello")
            assert r.status_code == 502, r.text
            assert "RemoteProtocolError" in r.json()["error"]["message"]
        finally:
            stop.set()
            t.join(5)
            if gw is not None:
                gw.stop()
            llm.stop()
            enc.stop()


def test_services_keep_idle_connections_longer_than_the_gateway_pools_them():
    def default(cls, name: str) -> float:
        return cls.model_fields[name].default

    timeouts = [default(cls, "keep_alive_timeout") for cls in (EncoderSettings, LLMSettings, GatewaySettings)]
    assert min(timeouts) > httpx.Limits().keepalive_expiry  # httpx's (and the openai client's) pool expiry
    assert default(GatewaySettings, "upstream_keepalive_expiry") < min(timeouts[:2])


def test_every_service_is_served_with_its_keep_alive_timeout(monkeypatch):
    import uvicorn

    import gateway.app
    from mmserve import cli

    seen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(kw["timeout_keep_alive"]))
    cli._serve(object(), GatewaySettings(keep_alive_timeout=41.0))
    gateway.app.run(GatewaySettings(keep_alive_timeout=42.0))
    assert seen == [41.0, 42.0]
