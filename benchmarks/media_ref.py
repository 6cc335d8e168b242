"""Media by reference vs by value on multi-turn image conversations through the real stack.

Stack (one process, real HTTP on loopback): encoder (tiny MiMo bundle's SigLIP, memory cache)
+ ``swa`` LLM (engine core in its own process, prefix cache on) + two gateways: one sending
keys (``media_by_ref=true``, ours), one sending the embeddings in every request
(``media_by_ref=false``, the previous design). Both serve the same workload shape with their
own images and texts (so neither warms the other's prefix cache).

Workload: ``--convs`` conversations of ``--turns`` turns, sequential; turn k re-sends the
whole history (every earlier image, answer and user text) and adds a user message with a new
image on odd turns. Greedy, 8 output tokens.

Reported per side: bytes of ``/v1/generate`` bodies (gateway -> LLM) per request, media items
sent, fetched by the LLM (a span past its cached prefix), skipped (the prefix cache covered
it), missed, bytes the LLM fetched from the encoder, all bytes into the LLM (bodies + fetches),
and the mean / p50 request latency.
Bytes and counts are exact; latencies are noisy on a shared CPU. The tiny model's image is
[16, 64] float32 (4 KiB): real models send ~1-4 MiB per image, which by value is paid on every
turn for every image in the history (the per-item figure scales; the ratio grows with it).

    flock /tmp/mmserve-bench.lock python -m benchmarks.media_ref [--quick]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._stack_util import make_png, scrape, total
from encoder_svc.app import create_app as encoder_app
from encoder_svc.server import serve_in_thread
from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread
from llm_svc.front.app import create_app as llm_app
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings
from mmserve.tiny_model import write_tiny_model

MODEL = "mmserve-tiny"


def metric(url: str, name: str, **labels) -> float:
    return total(scrape(url), name, **labels)


def counters(gw: str, llm: str) -> dict[str, float]:
    out = {o: metric(llm, "mmserve_llm_media_refs_total", outcome=o) for o in ("fetched", "skipped", "missed")}
    out["fetch_bytes"] = metric(llm, "mmserve_llm_media_fetch_bytes_total")
    out["body_bytes"] = metric(gw, "mmserve_gateway_llm_body_bytes_total")
    out["sent_ref"] = metric(gw, "mmserve_gateway_media_sent_total", how="ref")
    out["sent_value"] = metric(gw, "mmserve_gateway_media_sent_total", how="value")
    out["resends"] = metric(gw, "mmserve_gateway_media_resends_total")
    return out


def image_part(seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(make_png(seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def run_side(gw: str, llm: str, convs: int, turns: int, salt: int) -> dict:
    before = counters(gw, llm)
    latencies: list[float] = []
    requests = 0
    with httpx.Client(timeout=300) as c:
        for conv in range(convs):
            history: list[dict] = []
            for turn in range(turns):
                content: list[dict] = [{"type": "text", "text": f"conversation {salt}-{conv} turn {turn}: look"}]
                if turn % 2 == 0:
                    content.append(image_part(salt * 1000 + conv * 50 + turn))
                history.append({"role": "user", "content": content})
                body = {"model": MODEL, "messages": history, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                t0 = time.perf_counter()
                r = c.post(f"{gw}/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
                requests += 1
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    after = counters(gw, llm)
    d = {k: after[k] - before[k] for k in after}
    return {
        "requests": requests,
        "body_bytes_per_request": d["body_bytes"] / requests,
        "body_bytes_total": d["body_bytes"],
        "media_sent_by_ref": d["sent_ref"], "media_sent_by_value": d["sent_value"],
        "llm_fetched": d["fetched"], "llm_skipped_prefix_hit": d["skipped"], "llm_missed": d["missed"],
        "llm_fetch_bytes": d["fetch_bytes"], "resent_by_value": d["resends"],
        "bytes_into_llm_total": d["body_bytes"] + d["fetch_bytes"],
        "latency_mean_s": statistics.fmean(latencies), "latency_p50_s": statistics.median(latencies),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--convs", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    _results.add_mode_args(ap)
    a = ap.parse_args()
    convs = a.convs or (1 if a.smoke else 2 if a.quick else 6)
    turns = a.turns or (2 if a.smoke else 4 if a.quick else 8)
    with tempfile.TemporaryDirectory() as d:
        bundle = write_tiny_model(Path(d) / "tiny-mimo", arch="mimo")
        enc_settings = EncoderSettings(model_dir=str(bundle), cache_bytes=64 << 20)
        llm_settings = LLMSettings(model_dir=str(bundle), backend="swa", max_model_len=2048, kv_bytes=64 << 20)
        with serve_in_thread(encoder_app(enc_settings)) as enc, ServerThread(llm_app(llm_settings)) as llm:
            deadline = time.monotonic() + 300
            while httpx.get(llm.url + "/readyz", timeout=5).status_code != 200:
                if time.monotonic() > deadline:
                    raise SystemExit("the LLM did not become ready")
                time.sleep(0.2)
            sides = {}
            for name, by_ref, salt in (("by_value", False, 1), ("ours_by_ref", True, 2)):
                s = GatewaySettings(model_name=MODEL, encoder_urls=[enc], llm_urls=[llm.url], health_interval=0,
                                    dns_interval=0, media_by_ref=by_ref)
                with ServerThread(gateway_app(s)) as gw:
                    sides[name] = run_side(gw.url, llm.url, convs, turns, salt)
    ours, base = sides["ours_by_ref"], sides["by_value"]
    print(f"{'':28s} {'ours (by ref)':>16s} {'by value':>16s}")
    for k in ours:
        print(f"{k:28s} {ours[k]:16.4g} {base[k]:16.4g}")
    ratio = base["body_bytes_per_request"] / ours["body_bytes_per_request"]
    print(f"gateway->LLM bytes per request: {ratio:.2f}x fewer by reference; "
          f"{ours['llm_skipped_prefix_hit']:.0f} of {ours['media_sent_by_ref']:.0f} items never fetched (prefix hit)")
    _results.record("media_ref", ap, a, {"convs": convs, "turns": turns, "ours": ours, "by_value": base,
                                         "body_bytes_ratio": ratio}, kind="wall-clock",
                    baseline="media by value (every request carries the embeddings)",
                    summary=f"{convs} chats x {turns} turns: gateway->LLM bytes/request "
                            f"{ours['body_bytes_per_request']:.0f} vs {base['body_bytes_per_request']:.0f} ({ratio:.1f}x fewer), "
                            f"{ours['llm_skipped_prefix_hit']:.0f} of {ours['media_sent_by_ref']:.0f} items never fetched")


if __name__ == "__main__":
    _results.run(main)
