import asyncio

import httpx
import pytest

from gateway.fetch import MediaFetcher
from gateway.media import ByteBudget, MediaError, MediaRef
from gateway.ssrf import SSRFGuard

pytestmark = pytest.mark.unit

DNS = {"cdn.example": ["93.184.216.34"], "img.example": ["93.184.216.35"], "evil.example": ["10.0.0.7"]}


async def resolve(host: str, port: int) -> list[str]:
    if host not in DNS:
        raise OSError("nxdomain")
    return DNS[host]


def run_fetch(routes: dict, url: str, max_bytes: int = 100, budget: int = 1000, max_redirects: int = 2):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        key = (request.url.host, request.url.path)
        if key not in routes:
            return httpx.Response(404)
        status, headers, body = routes[key]
        return httpx.Response(status, headers=headers, content=body)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            fetcher = MediaFetcher(client, SSRFGuard(resolver=resolve), max_bytes=max_bytes, timeout=5,
                                   max_redirects=max_redirects)
            return await fetcher.fetch(MediaRef("image", "messages[0].content[0]", url), ByteBudget(budget))

    return asyncio.run(main()), seen


def test_connects_to_the_checked_address_keeping_host_and_sni():
    routes = {("93.184.216.34", "/a.png"): (200, {}, b"PNGDATA")}
    data, seen = run_fetch(routes, "https://cdn.example/a.png")
    assert data == b"PNGDATA"
    (req,) = seen
    assert str(req.url) == "https://93.184.216.34/a.png"
    assert req.headers["host"] == "cdn.example" and req.extensions["sni_hostname"] == "cdn.example"


def test_redirect_is_rechecked_and_pinned():
    routes = {
        ("93.184.216.34", "/a.png"): (302, {"location": "http://img.example:8080/b.png"}, b""),
        ("93.184.216.35", "/b.png"): (200, {}, b"B"),
    }
    data, seen = run_fetch(routes, "https://cdn.example/a.png")
    assert data == b"B" and seen[1].headers["host"] == "img.example:8080"


def test_redirect_to_private_address_refused_without_connecting():
    routes = {("93.184.216.34", "/a.png"): (301, {"location": "http://evil.example/x"}, b"")}
    with pytest.raises(MediaError, match="non-public address 10.0.0.7"):
        run_fetch(routes, "http://cdn.example/a.png")


def test_size_limits_declared_and_streamed_and_budget():
    routes = {("93.184.216.34", "/big"): (200, {}, b"x" * 101)}
    with pytest.raises(MediaError, match="exceeds 100 bytes"):
        run_fetch(routes, "http://cdn.example/big")
    routes = {("93.184.216.34", "/ok"): (200, {}, b"x" * 50)}
    with pytest.raises(MediaError, match="exceed 40 bytes in total"):
        run_fetch(routes, "http://cdn.example/ok", budget=40)


def test_redirect_loop_and_http_errors():
    routes = {("93.184.216.34", "/loop"): (302, {"location": "/loop"}, b"")}
    with pytest.raises(MediaError, match="too many redirects"):
        run_fetch(routes, "http://cdn.example/loop")
    with pytest.raises(MediaError, match="HTTP 404"):
        run_fetch({}, "http://cdn.example/missing")
