import asyncio
import gzip
import tracemalloc
import zlib

import httpx
import pytest

from gateway.media.fetch import MediaFetcher
from gateway.media.items import ByteBudget, MediaError, MediaRef
from gateway.media.ssrf import SSRFGuard

pytestmark = pytest.mark.unit

DNS = {"cdn.example": ["93.184.216.34"], "img.example": ["93.184.216.35"], "evil.example": ["10.0.0.7"]}


async def resolve(host: str, port: int) -> list[str]:
    if host not in DNS:
        raise OSError("nxdomain")
    return DNS[host]


class Chunks(httpx.AsyncByteStream):
    """A body streamed in chunks, as from a socket (``content=`` bytes would be read eagerly)."""

    def __init__(self, body: bytes, size: int = 4096) -> None:
        self.body, self.size = body, size

    async def __aiter__(self):
        for i in range(0, len(self.body), self.size):
            yield self.body[i : i + self.size]


def run_fetch(routes: dict, url: str, max_bytes: int = 100, budget: int = 1000, max_redirects: int = 2,
              chunk: int = 4096):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        key = (request.url.host, request.url.path)
        if key not in routes:
            return httpx.Response(404)
        status, headers, body = routes[key]
        return httpx.Response(status, headers=headers, stream=Chunks(body, chunk))

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


def gzip_bomb(decoded: int, level: int = 9) -> bytes:
    """``decoded`` zero bytes, gzip-compressed (about 1000:1), made without holding them."""
    c = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    parts = [c.compress(block) for _ in range(decoded >> 20)]
    return b"".join(parts) + c.flush()


def test_encoded_bodies_are_decoded_and_counted_after_decoding():
    body = b"media-bytes " * 5
    gz = gzip.compress(body)
    raw_deflate = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    routes = {
        ("93.184.216.34", "/gz"): (200, {"content-encoding": "gzip"}, gz),
        ("93.184.216.34", "/two"): (200, {"content-encoding": "gzip"}, gz + gzip.compress(b"!")),  # two members
        ("93.184.216.34", "/zlib"): (200, {"content-encoding": "deflate"}, zlib.compress(body)),
        ("93.184.216.34", "/raw"): (200, {"content-encoding": "deflate"}, raw_deflate.compress(body) + raw_deflate.flush()),
        ("93.184.216.34", "/chain"): (200, {"content-encoding": "gzip, deflate"}, zlib.compress(gz)),
    }
    for path, want in (("/gz", body), ("/two", body + b"!"), ("/zlib", body), ("/raw", body), ("/chain", body)):
        data, seen = run_fetch(routes, f"http://cdn.example{path}")
        assert data == want, path
        assert seen[0].headers["accept-encoding"] == "gzip, deflate"
    # 61 bytes compressed, 120 decoded: the cap is on decoded bytes and says which setting
    routes = {("93.184.216.34", "/gz"): (200, {"content-encoding": "gzip"}, gzip.compress(b"y" * 120))}
    with pytest.raises(MediaError, match=r"exceeds 100 bytes after gzip decoding \(max_media_bytes=100\)"):
        run_fetch(routes, "http://cdn.example/gz")


def test_gzip_bomb_refused_without_inflating_it():
    bomb = gzip_bomb(256 << 20)  # 256 MiB of zeros in ~250 KiB
    assert len(bomb) < 400_000
    routes = {("93.184.216.34", "/bomb"): (200, {"content-encoding": "gzip"}, bomb)}
    tracemalloc.start()
    try:
        with pytest.raises(MediaError, match=r"after gzip decoding \(max_media_bytes=1048576\)"):
            run_fetch(routes, "http://cdn.example/bomb", max_bytes=1 << 20, budget=1 << 30, chunk=65536)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"fetch held {peak} bytes for a 1 MiB cap"  # inflating a 64 KiB chunk whole: 64 MiB


def test_unsupported_or_corrupt_encoding_refused():
    routes = {
        ("93.184.216.34", "/br"): (200, {"content-encoding": "br"}, b"\x1b\x00"),
        ("93.184.216.34", "/bad"): (200, {"content-encoding": "gzip"}, b"\x1f\x8bnot gzip at all"),
    }
    with pytest.raises(MediaError, match="Content-Encoding 'br'; only gzip and deflate"):
        run_fetch(routes, "http://cdn.example/br")
    with pytest.raises(MediaError, match="gzip body is corrupt"):
        run_fetch(routes, "http://cdn.example/bad")
