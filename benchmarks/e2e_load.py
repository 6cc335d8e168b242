"""The whole local stack (2 encoders, ``--llms`` (2) ``swa`` LLM replicas, one gateway) under a mixed
multimodal multi-turn chat workload: cache-aware LLM routing vs round-robin, same run.

Workload (seeded, generated up front; identical for both sides):

* ``--sessions`` chat sessions (16, or 8 with --quick), at most ``--concurrency`` (4) running
  at once; each runs ``--turns`` turns (6, or 5 with --quick) one after another (a turn waits
  for the previous answer, as a user does).
* Each session uses one of 2 shared system prompts (~150 tokens each, sessions alternate), so
  sessions share a prefix as well as growing their own.
* Turn 1's user message carries an image from a pool of 6 PNGs shared by all sessions (images
  are reused across sessions: the encoder cache should hit); later turns add another pool image
  with probability 0.25, a 2 s H.264 clip (pool of 2) or a 1 s WAV tone (pool of 2) with
  probability 0.1 each. User texts are 6-20 words from a small vocabulary.
* Turn k+1's messages are turn k's messages + the model's answer (greedy, temperature 0, so
  both sides produce the same answers) + the next user message. ``max_tokens`` is 6-12.
* Requests stream (``stream_options.include_usage``).

Wall-clock. Sides: a fresh stack per side and repeat (cold caches every time), same model,
same workload; only the gateway's ``llm_routing`` differs. ``--repeats`` (3) rounds, the side
order alternating (RR, CA / CA, RR / ...); medians and [min, max] are reported.

Measured per side: requests/s (requests / wall time of the workload), TTFT p50/p90 (request
sent -> first non-empty content chunk, at the client), encoder cache hit ratio (hits / lookups
from the encoders' /metrics), prefix cache hit ratio (sum of ``cached_tokens`` / sum of
``prompt_tokens`` from the usage chunks), LLM requests per replica. Target: cache-aware prefix
hit ratio clearly above round-robin's (ratio >= 1.25), TTFT p90 no worse (ratio <= 1.10,
allowing for noise on a shared 2-core machine).

    python -m benchmarks.e2e_load [--quick] [--sessions N] [--turns T] [--concurrency C] [--seed S] [--llms M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from benchmarks import _results
from benchmarks._chat_load import drive, one_request, openai_client
from benchmarks._stats import percentile, scaled
from benchmarks._stack_util import audio_part, image_part, make_mp4, make_png, make_wav, scrape, total, user, video_part
from mmserve.launcher import LocalStack, StackSpec

WORDS = (
    "please explain the picture again with more detail about colors shapes edges light shadow "
    "texture pattern sound rhythm motion scene object left right top bottom center why how "
    "compare contrast summarize list steps briefly carefully"
).split()
SYSTEM_PROMPTS = [
    "You are a careful visual assistant for an online museum. Describe exhibits precisely, "
    "mention materials, era and condition, and never invent provenance. " * 3,
    "You are a concise media analyst. For every image, clip or recording, report what is "
    "visible or audible, then one sentence of interpretation, then stop. " * 3,
]
TARGET_HIT_RATIO = 1.25
TARGET_TTFT_P90 = 1.10


@dataclass
class Turn:
    text: str
    media: list[tuple[str, int]]  # (modality, pool index)
    max_tokens: int


@dataclass
class Session:
    system: int
    turns: list[Turn]


def make_workload(seed: int, sessions: int, turns: int) -> list[Session]:
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        ts = []
        for k in range(turns):
            media: list[tuple[str, int]] = []
            if k == 0 or rng.random() < 0.25:
                media.append(("image", rng.randrange(6)))
            if k > 0 and rng.random() < 0.1:
                media.append(("video", rng.randrange(2)))
            if k > 0 and rng.random() < 0.1:
                media.append(("audio", rng.randrange(2)))
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
            ts.append(Turn(text, media, rng.randint(6, 12)))
        out.append(Session(system=s % len(SYSTEM_PROMPTS), turns=ts))
    return out


def media_pools() -> dict[str, list[dict]]:
    return {
        "image": [image_part(make_png(64, 64, seed=100 + i)) for i in range(6)],
        "video": [video_part(make_mp4(seconds=2.0, seed=i)) for i in range(2)],
        "audio": [audio_part(make_wav(seconds=1.0, freq=300.0 + 200 * i)) for i in range(2)],
    }


@dataclass
class Record:
    turn: int
    ttft: float | None
    prompt_tokens: int
    cached_tokens: int


@dataclass
class SideResult:
    records: list[Record] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


async def stream_turn(client, model: str, messages: list[dict], max_tokens: int, result: SideResult,
                      turn: int) -> str | None:
    """One streamed greedy chat turn (``benchmarks._chat_load.one_request``, answers may stop at
    EOS): its ``Record`` (TTFT, prompt and cached tokens) goes to ``result``; returns the answer's
    text, or None after recording the error."""
    rec = await one_request(client, model, messages, max_tokens, ignore_eos=False)
    if rec.error is None and not rec.usage:
        rec.error = "stream ended without a usage chunk"
    if rec.error is not None:
        result.errors.append(rec.error)
        return None
    result.records.append(Record(turn, rec.ttft, rec.prompt_tokens, rec.cached_tokens or 0))
    return rec.text


async def run_session(client, model: str, session: Session, pools, result: SideResult) -> None:
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPTS[session.system]}]
    for k, turn in enumerate(session.turns):
        messages.append(user(turn.text, *(pools[m][i] for m, i in turn.media)))
        text = await stream_turn(client, model, messages, turn.max_tokens, result, k)
        if text is None:
            return
        messages.append({"role": "assistant", "content": text})


async def run_workload(url: str, model: str, workload: list[Session], pools, concurrency: int) -> SideResult:
    """Every session, ``concurrency`` at a time (``benchmarks._chat_load.drive``)."""
    result = SideResult()
    client = openai_client(url, timeout=300)
    try:
        _, result.wall_s = await drive(len(workload), lambda i: run_session(client, model, workload[i], pools, result),
                                       concurrency)
    finally:
        await client.close()
    return result


def encoder_hits(stack: LocalStack) -> tuple[float, float]:
    hits = misses = 0.0
    for e in stack.encoders:
        m = scrape(e.url)
        hits += total(m, "encoder_cache_lookups_total", result="hit")
        misses += total(m, "encoder_cache_lookups_total", result="miss")
    return hits, misses


def run_side(model_dir: str, policy: str, workload, pools, concurrency: int, log_dir: str, llms: int = 2,
             encoders: int = 2) -> dict:
    spec = StackSpec(
        model_dir=model_dir, gateway_port=0, encoders=encoders, llms=llms, llm_backend="swa", llm_routing=policy
    )
    t_start = time.perf_counter()
    with LocalStack(spec, log_dir=f"{log_dir}/{policy}") as stack:
        stack.wait_ready(timeout=300)
        startup = time.perf_counter() - t_start
        h0, m0 = encoder_hits(stack)
        res = asyncio.run(run_workload(stack.url, stack.model_name, workload, pools, concurrency))
        h1, m1 = encoder_hits(stack)
        per_replica = [int(total(scrape(s.url), "mmserve_llm_requests_total")) for s in stack.llms]
    ttfts = [r.ttft for r in res.records if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in res.records)
    cached = sum(r.cached_tokens for r in res.records)
    lookups = (h1 - h0) + (m1 - m0)
    by_turn = []
    for k in range(max((r.turn for r in res.records), default=-1) + 1):
        rs = [r for r in res.records if r.turn == k]
        p = sum(r.prompt_tokens for r in rs)
        by_turn.append(round(sum(r.cached_tokens for r in rs) / p, 3) if p else 0.0)
    return {
        "policy": policy,
        "requests": len(res.records),
        "errors": len(res.errors),
        "first_error": res.errors[0] if res.errors else None,
        "wall_s": round(res.wall_s, 2),
        "requests_per_s": round(len(res.records) / res.wall_s, 3) if res.wall_s else 0.0,
        "ttft_p50_ms": scaled(percentile(ttfts, 50), 1000),
        "ttft_p90_ms": scaled(percentile(ttfts, 90), 1000),
        "encoder_cache_hit_ratio": round((h1 - h0) / lookups, 4) if lookups else 0.0,
        "prefix_cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_cache_hit_ratio_by_turn": by_turn,
        "llm_requests_per_replica": per_replica,
        "stack_startup_s": round(startup, 1),
    }


SUMMARY_KEYS = ("requests_per_s", "ttft_p50_ms", "ttft_p90_ms", "encoder_cache_hit_ratio", "prefix_cache_hit_ratio")


def summarize(runs: list[dict]) -> dict:
    """Median and [min, max] of each headline metric over the repeats of one side."""
    out = {}
    for k in SUMMARY_KEYS:
        vals = [r[k] for r in runs]
        out[k] = {"median": round(statistics.median(vals), 4), "min": min(vals), "max": max(vals)}
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 sessions x 5 turns")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llms", type=int, default=2, help="LLM replicas behind the gateway")
    ap.add_argument("--encoders", type=int, default=2, help="encoder replicas behind the gateway")
    ap.add_argument("--repeats", type=int, default=3, help="fresh stacks per side; the order alternates")
    ap.add_argument("--model", default=None, help="bundle dir (default: the tiny mimo bundle)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:  # one fresh stack per side (one encoder, one LLM), two short sessions
        args.repeats, args.concurrency, args.encoders, args.llms = 1, 2, 1, 1
    sessions = args.sessions or (2 if args.smoke else 8 if args.quick else 16)
    turns = args.turns or (2 if args.smoke else 5 if args.quick else 6)

    from mmserve.cli import ensure_default_model

    model_dir = ensure_default_model(args.model)
    workload = make_workload(args.seed, sessions, turns)
    pools = media_pools()
    n_media = {m: sum(1 for s in workload for t in s.turns for mm, _ in t.media if mm == m) for m in pools}
    print(
        f"workload: {sessions} sessions x {turns} turns = {sessions * turns} requests, concurrency "
        f"{args.concurrency}, seed {args.seed}, media items {n_media}, {args.llms} LLM replicas, "
        f"{args.repeats} repeats (side order alternates)", flush=True,
    )  # fmt: skip
    log_dir = tempfile.mkdtemp(prefix="mmserve-e2e-load-")
    print(f"service logs under {log_dir}", flush=True)
    runs: dict[str, list[dict]] = {"round_robin": [], "cache_aware": []}
    for rep in range(args.repeats):
        order = ("round_robin", "cache_aware") if rep % 2 == 0 else ("cache_aware", "round_robin")
        for policy in order:
            r = run_side(model_dir, policy, workload, pools, args.concurrency, f"{log_dir}/{rep}", args.llms, args.encoders)
            runs[policy].append(r)
            print(
                f"[{rep}] {policy:12s} req/s {r['requests_per_s']:6.2f}  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                f"p90 {r['ttft_p90_ms']:7.1f} ms  encoder hit {r['encoder_cache_hit_ratio']:.3f}  "
                f"prefix hit {r['prefix_cache_hit_ratio']:.3f} ({r['cached_tokens']}/{r['prompt_tokens']})  "
                f"per replica {r['llm_requests_per_replica']}  errors {r['errors']}", flush=True,
            )  # fmt: skip
    ca, rr = summarize(runs["cache_aware"]), summarize(runs["round_robin"])
    med = lambda side, k: side[k]["median"]  # noqa: E731
    ratios = {
        "prefix_cache_hit_ratio": round(med(ca, "prefix_cache_hit_ratio") / med(rr, "prefix_cache_hit_ratio"), 3)
        if med(rr, "prefix_cache_hit_ratio") else float("inf"),
        "ttft_p90": round(med(ca, "ttft_p90_ms") / med(rr, "ttft_p90_ms"), 3),
        "ttft_p50": round(med(ca, "ttft_p50_ms") / med(rr, "ttft_p50_ms"), 3),
        "requests_per_s": round(med(ca, "requests_per_s") / med(rr, "requests_per_s"), 3),
    }
    per_repeat_hit = [round(c["prefix_cache_hit_ratio"] / r["prefix_cache_hit_ratio"], 3) if r["prefix_cache_hit_ratio"]
                      else None for c, r in zip(runs["cache_aware"], runs["round_robin"])]
    target_met = (
        ratios["prefix_cache_hit_ratio"] >= TARGET_HIT_RATIO
        and ratios["ttft_p90"] <= TARGET_TTFT_P90
        and ca["errors"] == rr["errors"] == 0
    )
    print(f"\nmedian [min, max] over {args.repeats} repeats:")
    for k in SUMMARY_KEYS:
        print(f"  {k:24s} round_robin {rr[k]['median']:9.3f} [{rr[k]['min']}, {rr[k]['max']}]   "
              f"cache_aware {ca[k]['median']:9.3f} [{ca[k]['min']}, {ca[k]['max']}]")
    print(
        f"cache_aware / round_robin (medians): prefix hit x{ratios['prefix_cache_hit_ratio']} (per repeat "
        f"{per_repeat_hit}), TTFT p90 x{ratios['ttft_p90']}, TTFT p50 x{ratios['ttft_p50']}, "
        f"req/s x{ratios['requests_per_s']}; target (hit >= x{TARGET_HIT_RATIO}, p90 <= x{TARGET_TTFT_P90}) "
        f"{'met' if target_met else 'NOT met'}", flush=True,
    )  # fmt: skip
    figures = {
        "quick": args.quick,
        "workload": {"sessions": sessions, "turns": turns, "concurrency": args.concurrency, "llm_replicas": args.llms,
                     "seed": args.seed, "media_items": n_media, "repeats": args.repeats},
        "round_robin": rr,
        "cache_aware": ca,
        "ratio_cache_aware_over_round_robin": ratios,
        "prefix_hit_ratio_per_repeat": per_repeat_hit,
        "runs": runs,
        "target_met": target_met,
    }  # fmt: skip
    r = ratios
    _results.record("e2e_load", ap, args, figures, kind="wall-clock", baseline="round-robin LLM routing",
                    summary=f"{args.llms} replicas: prefix hit {med(ca, 'prefix_cache_hit_ratio'):.3f} vs "
                            f"{med(rr, 'prefix_cache_hit_ratio'):.3f} (x{r['prefix_cache_hit_ratio']}, per repeat "
                            f"{per_repeat_hit}), TTFT p90 {r['ttft_p90']}x, p50 {r['ttft_p50']}x, "
                            f"req/s {r['requests_per_s']}x (medians of {args.repeats})")


if __name__ == "__main__":
    _results.run(main)
