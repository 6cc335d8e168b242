"""Where does the LLM service's memory grow?  Serves N mixed requests to one LLM app in this
process (front here, engine core in its own process), then reports the front's tracemalloc
growth by allocation site and the RSS of front and core over time.  A diagnosis aid for
issue 11 item 7 (not a benchmark: no baseline)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tracemalloc

import httpx

from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from shared.settings import LLMSettings
from mmserve.tiny_model import write_tiny_model
from shared.wire import SAFETENSORS_MIME, pack


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def body(i: int, rng: random.Random) -> bytes:
    words = " ".join(rng.choice(["red", "blue", "cat", "dog", "sky", "sea"]) for _ in range(rng.randint(5, 60)))
    req = GenerateRequest(request_id=f"r{i}", stream=bool(i % 2), sampling=SamplingParams(max_tokens=rng.randint(1, 8)),
                          messages=[PromptMessage(role="user", content=[PromptText(text=f"{i % 50} {words}")])])
    return pack({}, req)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--model", default="/tmp/mmserve-rss-model")
    ap.add_argument("--kv-bytes", type=int, default=256 * 1024 * 1024)
    ap.add_argument("--no-host-tier", action="store_true", help="host (L2) KV pools off")
    args = ap.parse_args()
    write_tiny_model(args.model, arch="mimo")
    from llm_svc.front.app import create_app

    host = {"host_kv_full_bytes": 0, "host_kv_swa_bytes": 0} if args.no_host_tier else {}
    app = create_app(LLMSettings(model_dir=args.model, max_model_len=1024, kv_bytes=args.kv_bytes, **host))
    state = app.state.svc
    await state.load()
    assert state.ready, state.error
    core = state.backend.client.core_pid
    rng = random.Random(0)
    series = []
    snap0 = None
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
        for i in range(args.requests):
            r = await c.post("/v1/generate", content=body(i, rng), headers={"content-type": SAFETENSORS_MIME})
            assert r.status_code == 200, r.text
            if i == args.requests // 5:
                tracemalloc.start(8)
                snap0 = tracemalloc.take_snapshot()
            if i % 100 == 0:
                stats = state.backend.stats()
                series.append({"i": i, "front_mb": round(rss_mb(), 1), "core_mb": round(rss_mb(core), 1),
                               "kv_full_usage": round(stats.kv_full_usage, 5), "kv_swa_usage": round(stats.kv_swa_usage, 5)})
                print(series[-1], flush=True)
    snap1 = tracemalloc.take_snapshot()
    top = snap1.compare_to(snap0, "traceback")[:8]
    for stat in top:
        print(f"{stat.size_diff / 1024:+.1f} KiB {stat.count_diff:+d} blocks")
        for line in stat.traceback.format()[-8:]:
            print("   ", line)
    print(json.dumps({"series": series}))
    await state.close()


if __name__ == "__main__":
    asyncio.run(main())
