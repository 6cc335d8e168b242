"""The gateway's /dashboard in headless Chromium (Debian's, installed by scripts/setup.sh --test)
against a running stack: the numbers it shows are the replicas' /metrics; a screenshot is kept
(``MMSERVE_SCREENSHOT_DIR``, default the test's tmp dir)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.settings import GatewaySettings
from tests.conftest import make_png

pytestmark = pytest.mark.e2e

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--virtual-time-budget=6000", "--window-size=1300,1500", "--hide-scrollbars",
]  # fmt: skip


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "Debian's chromium is not installed (scripts/setup.sh --test installs it)"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


class _Cells(HTMLParser):
    """id -> text of every element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, str] = {}
        self._open: list[str | None] = []
        self.body_ready = "0"

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body_ready = a.get("data-ready", "0")
        if tag in ("td", "span"):
            self._open.append(a.get("id"))
            if a.get("id"):
                self.cells[a["id"]] = ""

    def handle_endtag(self, tag):
        if tag in ("td", "span") and self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._open and self._open[-1]:
            self.cells[self._open[-1]] += data


def metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _chat(stack, png: bytes, text: str) -> None:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = {"model": stack.model_name, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert "[DONE]" in "".join(r.iter_text())


def test_dashboard_shows_the_replicas_metrics_in_chromium(stack, tmp_path):
    a, b = make_png(64, 64, seed=1), make_png(64, 64, seed=2)
    for png, text in ((a, "Describe the image."), (a, "Describe the image."), (b, "And this one?")):
        _chat(stack, png, text)  # a repeated image (encoder cache hit) and a repeated prompt (prefix hit)

    page = chromium(["--dump-dom", f"{stack.url}/dashboard"], tmp_path / "profile-dom")
    assert page.returncode == 0, page.stderr[-2000:]
    dom = _Cells()
    dom.feed(page.stdout)
    assert int(dom.body_ready) >= 1, page.stdout[:2000]  # the page rendered at least one poll
    cells = dom.cells

    llm = httpx.get(f"{stack.llms[0].url}/metrics", timeout=10).text
    enc = httpx.get(f"{stack.encoders[0].url}/metrics", timeout=10).text
    assert cells["llm-0-url"] == stack.llms[0].url
    prompt = metric(llm, "mmserve_llm_prompt_tokens_total")
    hits = metric(llm, "mmserve_llm_prefix_hit_tokens_total")
    assert prompt > 0 and hits > 0
    assert cells["llm-0-prompt_tokens"] == str(round(prompt))
    assert cells["llm-0-prefix_hit_tokens"] == str(round(hits))
    assert cells["llm-0-prefix_hit_rate"] == f"{100 * hits / prompt:.1f}%"
    assert cells["llm-0-generation_tokens"] == str(round(metric(llm, "mmserve_llm_generation_tokens_total")))
    for pool in ("full", "swa"):
        assert cells[f"llm-0-kv_{pool}_usage"] == f"{100 * metric(llm, 'mmserve_llm_kv_pool_usage', pool=pool):.1f}%"
    assert cells["llm-0-ttft_p50"].endswith(" ms") and cells["llm-0-itl_p50"].endswith(" ms")

    lookups = metric(enc, "encoder_cache_lookups_total")
    enc_hits = metric(enc, "encoder_cache_lookups_total", result="hit")
    assert lookups >= 3 and enc_hits >= 1
    assert cells["encoder-0-cache_lookups"] == str(round(lookups))
    assert cells["encoder-0-cache_hits"] == str(round(enc_hits))
    assert cells["encoder-0-cache_hit_rate"] == f"{100 * enc_hits / lookups:.1f}%"
    passes, items = metric(enc, "encoder_forward_passes_total"), metric(enc, "encoder_forward_items_total")
    assert cells["encoder-0-forward_passes"] == str(round(passes))
    assert cells["encoder-0-mean_batch_size"] == f"{items / passes:.2f}"
    assert re.search(r'id="chart-(ttft|itl|batch|kv)"', page.stdout), "charts were not drawn"

    out = Path(os.environ.get("MMSERVE_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "dashboard.png"
    r = chromium([f"--screenshot={shot}", f"{stack.url}/dashboard"], tmp_path / "profile-shot")
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


class _URLSpy:
    """Wraps the gateway app: records every request's path and query string."""

    def __init__(self, app) -> None:
        self.app, self.urls = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.urls.append(scope["path"] + "?" + scope["query_string"].decode())
        await self.app(scope, receive, send)


@pytest.fixture
def fake_gateway():
    """A gateway in front of the fake services, built by ``make(**settings)``."""
    enc, llm = ServerThread(fake_encoder_app("e")).start(), ServerThread(fake_llm_app("l")).start()
    servers: list[ServerThread] = []

    def make(**kw) -> tuple[ServerThread, _URLSpy]:
        spy = _URLSpy(create_app(GatewaySettings(model_name="m", encoder_urls=[enc.url], llm_urls=[llm.url],
                                                 dns_interval=0, health_interval=0, **kw)))
        servers.append(ServerThread(spy).start())
        return servers[-1], spy

    yield make, llm
    for s in servers:
        s.stop()
    enc.stop()
    llm.stop()


def _dom(url: str, profile: Path) -> _Cells:
    page = chromium(["--dump-dom", url], profile)
    assert page.returncode == 0, page.stderr[-2000:]
    dom = _Cells()
    dom.feed(page.stdout)
    return dom


def test_the_dashboard_takes_its_key_from_the_fragment_never_the_url(fake_gateway, tmp_path):
    make, llm = fake_gateway
    gw, spy = make(api_keys=["k-dash"])
    dom = _dom(f"{gw.url}/dashboard#key=k-dash", tmp_path / "with-key")
    assert int(dom.body_ready) >= 1  # the data answered: the key went as a bearer header
    assert dom.cells["llm-0-url"].startswith(llm.url)  # (down: the fake LLM has no /metrics)
    assert spy.urls and not [u for u in spy.urls if "k-dash" in u]  # no URL the server saw carried it
    without = _dom(f"{gw.url}/dashboard", tmp_path / "without-key")
    assert without.body_ready == "0" and without.cells["auth"] == "this gateway needs an API key"
    wrong = _dom(f"{gw.url}/dashboard#key=nope", tmp_path / "wrong-key")
    assert wrong.body_ready == "0" and "refused" in wrong.cells["auth"]


def test_the_dashboard_shows_an_open_gateways_warning(fake_gateway, tmp_path):
    make, _ = fake_gateway
    gw, _ = make(host="0.0.0.0")  # no keys, said to listen beyond loopback
    dom = _dom(f"{gw.url}/dashboard", tmp_path / "open")
    assert int(dom.body_ready) >= 1
    assert "MMSERVE_GATEWAY_API_KEYS" in dom.cells["warning-0"]
    closed, _ = make(host="127.0.0.1")
    assert "warning-0" not in _dom(f"{closed.url}/dashboard", tmp_path / "closed").cells
