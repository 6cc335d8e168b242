"""The client side of ``benchmarks.vs_vllm``: a seeded chat trace of random pseudo-word prompts
with exact token counts, a streaming OpenAI client that times every content chunk, and the
numbers (tok/s, TTFT / ITL / TPOT percentiles, greedy agreement between two servers)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import openai


# ---- trace -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    prompt: str
    prompt_tokens: int  # of the user text alone (the chat template adds a few)
    max_tokens: int


class PromptMaker:
    """Random pseudo-word texts of an exact token count (the pre-tokenizer splits on spaces, so
    a text's token count is the sum of its words' counts)."""

    def __init__(self, tokenizer, words: list[str]):
        self.words = words
        enc = tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]
        self.cost = {w: len(ids) for w, ids in zip(words, enc)}

    def text(self, rng: random.Random, tokens: int) -> tuple[str, int]:
        out, n = [], 0
        while n < tokens:
            w = rng.choice(self.words)
            out.append(w)
            n += self.cost[w]
        return " ".join(out), n  # the first word has no leading space: +-1 token


def make_trace(maker: PromptMaker, seed: int, n: int, prompt_range, output_range) -> list[Item]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        text, k = maker.text(rng, rng.randint(*prompt_range))
        items.append(Item(text, k, rng.randint(*output_range)))
    return items


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- client ------------------------------------------------------------------------------------
@dataclass
class Record:
    ttft: float | None = None
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    error: str | None = None


async def one_request(client: openai.AsyncOpenAI, model: str, item: Item) -> Record:
    rec, pieces = Record(), []
    t0 = last = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": item.prompt}],
            max_tokens=item.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                rec.completion_tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.gaps.append(now - last)
                    last = now
                    pieces.append(c.delta.content)
    except openai.APIError as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.e2e = time.perf_counter() - t0
    rec.text = "".join(pieces)
    return rec


async def run_load(url: str, model: str, trace: list[Item], concurrency: int | None, arrivals: list[float] | None):
    """Records in trace order and the wall time (first send -> last answer); ``concurrency`` caps
    the requests in flight, ``arrivals`` (seconds from the start) delays each request."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=900, max_retries=0)
    sem = asyncio.Semaphore(concurrency or len(trace))
    t0 = time.perf_counter()

    async def one(i: int) -> Record:
        if arrivals is not None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        async with sem:
            return await one_request(client, model, trace[i])

    try:
        records = await asyncio.gather(*(one(i) for i in range(len(trace))))
    finally:
        await client.close()
    return list(records), time.perf_counter() - t0


# ---- numbers -----------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_stats(records: list[Record], wall: float, trace: list[Item]) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.ttft and r.completion_tokens > 1]
    return {
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "short_outputs": sum(r.completion_tokens < it.max_tokens for r, it in zip(records, trace) if not r.error),
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "req_s": round(len(ok) / wall, 4),
        "ttft_p50_ms": round(1000 * pct(ttfts, 50), 1),
        "ttft_p90_ms": round(1000 * pct(ttfts, 90), 1),
        "itl_p50_ms": round(1000 * pct(gaps, 50), 1),
        "tpot_p50_ms": round(1000 * pct(tpots, 50), 1),
        "e2e_p50_s": round(pct([r.e2e for r in ok], 50), 2),
        "_ttfts": ttfts, "_gaps": gaps, "_tpots": tpots,
    }  # fmt: skip


def side_summary(runs: list[dict]) -> dict:
    """Mean tok/s over the side's runs; latency percentiles over all its requests pooled."""
    pool = {k: [x for r in runs for x in r[k]] for k in ("_ttfts", "_gaps", "_tpots")}
    return {
        "runs": len(runs),
        "output_tok_s": round(statistics.fmean(r["output_tok_s"] for r in runs), 2),
        "output_tok_s_runs": [r["output_tok_s"] for r in runs],
        "req_s": round(statistics.fmean(r["req_s"] for r in runs), 4),
        "ttft_p50_ms": round(1000 * pct(pool["_ttfts"], 50), 1),
        "ttft_p90_ms": round(1000 * pct(pool["_ttfts"], 90), 1),
        "itl_p50_ms": round(1000 * pct(pool["_gaps"], 50), 1),
        "tpot_p50_ms": round(1000 * pct(pool["_tpots"], 50), 1),
        "errors": sum(r["errors"] for r in runs),
        "short_outputs": sum(r["short_outputs"] for r in runs),
        "disturbed_runs": sum(bool(r.get("disturbed")) for r in runs),
        "foreign_cores_runs": [r["cpu_cores"]["foreign"] for r in runs if "cpu_cores" in r],
    }


def agreement(a: list[Record], b: list[Record]) -> tuple[int, float]:
    """(identical outputs, mean share of the shorter text that is a common prefix)."""
    same, shares = 0, []
    for x, y in zip(a, b):
        same += x.error is None and y.error is None and x.text == y.text
        n = min(len(x.text), len(y.text))
        k = next((i for i in range(n) if x.text[i] != y.text[i]), n)
        shares.append(k / n if n else 0.0)
    return same, round(statistics.fmean(shares), 3) if shares else 0.0
