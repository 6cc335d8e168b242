"""Bounded-load spillover of the encoder ring with three real encoder services over HTTP (issue 11,
Routing): while one encoder is busy with a real long video, an image whose home it is goes to the
next encoder on the ring; with even loads every image lands on its home encoder. The LLM is the
gateway's fake (it is not under test here); which encoder served an item is read from the
encoders' own /metrics."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._stack_util import image_part, make_mp4, make_png, user, video_part
from encoder_svc.app import create_app as encoder_app
from encoder_svc.server import serve_in_thread
from gateway.app import create_app as gateway_app
from gateway.routing.encoder_ring import EncoderRing
from mmserve.testing.fake_services import ServerThread, fake_llm_app
from shared.hashing import content_hash
from shared.settings import EncoderSettings, GatewaySettings

pytestmark = pytest.mark.integration
MODEL = "m"


def image_requests(url: str) -> float:
    """Image encodes this encoder answered (any status)."""
    n = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "encoder_requests_total" and s.labels.get("modality") == "image":
                n += s.value
    return n


def chat(c: httpx.Client, *parts: dict) -> None:
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": [user("describe", *parts)]})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def stack(mimo_bundle):
    # a long video sampled densely: thousands of frames through the vision tower, seconds of work
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, video_fps=16.0, video_max_frames=1024)
    with serve_in_thread(encoder_app(s)) as e0, serve_in_thread(encoder_app(s)) as e1, \
            serve_in_thread(encoder_app(s)) as e2:
        llm = ServerThread(fake_llm_app("l0")).start()
        gw_app = gateway_app(GatewaySettings(model_name=MODEL, encoder_urls=[e0, e1, e2], llm_urls=[llm.url],
                                             dns_interval=0, health_interval=0, encoder_load_factor=1.5))
        try:
            with ServerThread(gw_app).start() as gw:
                yield [e0, e1, e2], gw, gw_app.state.gateway.encoders
        finally:
            llm.stop()


def homed(ring: EncoderRing, home: str, make, start: int = 0):
    """The first ``make(seed)`` (seed >= start) whose ring owner is ``home``."""
    for seed in range(start, start + 200):
        data = make(seed)
        if ring.owner(content_hash(data)) == home:
            return data
    raise AssertionError(f"no item homed on {home}")


def test_even_loads_keep_every_image_on_its_home_encoder(stack):
    encoders, gw, _ = stack
    ring = EncoderRing(encoders)
    pngs = [make_png(seed=1000 + i) for i in range(12)]
    homes = {ring.owner(content_hash(p)) for p in pngs}
    assert len(homes) >= 2, "the images should spread over the ring"
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for png in pngs:  # one at a time: every encoder idle when the gateway picks one
            before = {u: image_requests(u) for u in encoders}
            chat(c, image_part(png))
            after = {u: image_requests(u) for u in encoders}
            served = [u for u in encoders if after[u] > before[u]]
            assert served == [ring.owner(content_hash(png))]


def test_busy_encoder_hands_its_images_to_the_next_on_the_ring(stack):
    encoders, gw, client = stack
    ring = EncoderRing(encoders)
    busy = encoders[0]
    video = homed(ring, busy, lambda seed: make_mp4(seconds=64.0, size=64, fps=16, seed=seed))
    png = homed(ring, busy, lambda seed: make_png(seed=seed), start=2000)
    spill_to = ring.candidates(content_hash(png))[1]
    done = threading.Event()

    def long_video() -> None:
        with httpx.Client(base_url=gw.url, timeout=300) as c:
            chat(c, video_part(video))
        done.set()

    t = threading.Thread(target=long_video, daemon=True)
    t.start()
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        while client.load(busy) == 0:  # the video's encode is on its home encoder now
            assert not done.is_set() and t.is_alive(), "the video finished before it was seen in flight"
            time.sleep(0.002)
        # busy: 1 in flight against a mean of 2/3 (this image counted); 1.5x the mean = 1: full
        before = {u: image_requests(u) for u in encoders}
        chat(c, image_part(png))
        in_flight_after = client.load(busy)
        after = {u: image_requests(u) for u in encoders}
    assert in_flight_after == 1 and not done.is_set(), "the video must still be encoding (the load was real)"
    assert [u for u in encoders if after[u] > before[u]] == [spill_to]
    t.join(timeout=300)
    assert done.is_set()
    with httpx.Client(base_url=gw.url, timeout=120) as c:  # loads even again: back home
        before = image_requests(busy)
        chat(c, image_part(png))
        assert image_requests(busy) == before + 1
