"""The load client of the benchmarks that drive a server: seeded traces of random pseudo-word
prompts with exact token counts (single chats, and multi-turn agent sessions that share one
system prompt and grow by each answer plus a tool result), the one OpenAI client factory
(``openai_client``), a streaming request that times every content chunk and reads the usage
chunk (completion and cached prompt tokens), the drivers (``run_load``: a trace at a
concurrency or arrival times; ``run_agent``; ``closed_loop``: N workers each sending its next
turn as soon as the last one ends) and the numbers (tok/s, TTFT / ITL / TPOT percentiles from
``benchmarks._stats``, prefix-cache hit rate, greedy agreement between two servers)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import openai

from benchmarks._stats import percentile, scaled


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


@dataclass(frozen=True)
class AgentSession:
    """One agent session: ``task`` opens it; turn k > 0 appends the model's previous answer and
    ``tool_results[k - 1]`` as the next user message; ``max_tokens[k]`` per turn."""

    task: str
    tool_results: tuple[str, ...]
    max_tokens: tuple[int, ...]
    prompt_tokens: int  # task + tool results + the shared system prompt (answers not counted)


def make_agent_trace(maker: PromptMaker, seed: int, sessions: int, turns: int, system_tokens: int,
                     task_range, tool_range, output_range) -> tuple[str, list[AgentSession]]:  # fmt: skip
    """(shared system prompt, sessions); seeded, identical for both sides."""
    rng = random.Random(seed)
    system, sys_n = maker.text(rng, system_tokens)
    out = []
    for _ in range(sessions):
        task, n = maker.text(rng, rng.randint(*task_range))
        tools = []
        for _ in range(turns - 1):
            t, k = maker.text(rng, rng.randint(*tool_range))
            tools.append(t)
            n += k
        out.append(AgentSession(task, tuple(tools), tuple(rng.randint(*output_range) for _ in range(turns)), n + sys_n))
    return "You are an agent. Tools answer in pseudo-words. " + system, out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- client ------------------------------------------------------------------------------------
def openai_client(url: str, timeout: float = 900) -> openai.AsyncOpenAI:
    """The client every load sends with: ``{url}/v1``, no retries (a failed request is a figure)."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)


async def closed_loop(workers: int, turn: Callable[[int, int], Awaitable[None]], done: Callable[[], bool]) -> None:
    """``workers`` closed loops at once: worker ``k`` awaits ``turn(k, i)`` for i = 0, 1, ...,
    each as soon as the one before ends, until ``done()`` (asked before every turn)."""

    async def worker(k: int) -> None:
        i = 0
        while not done():
            await turn(k, i)
            i += 1

    await asyncio.gather(*(worker(k) for k in range(workers)))


@dataclass
class Record:
    ttft: float | None = None
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0  # as the server counted them (chat template included)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: not sent)
    max_tokens: int = 0
    error: str | None = None


async def one_request(client: openai.AsyncOpenAI, model: str, item: Item | list[dict], max_tokens: int = 0) -> Record:
    """One streamed chat completion: ``item`` (one user message) or a message list with ``max_tokens``."""
    messages = [{"role": "user", "content": item.prompt}] if isinstance(item, Item) else item
    max_tokens = item.max_tokens if isinstance(item, Item) else max_tokens
    rec, pieces = Record(max_tokens=max_tokens), []
    t0 = last = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                rec.completion_tokens = chunk.usage.completion_tokens
                rec.prompt_tokens = chunk.usage.prompt_tokens or 0
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                if details is not None and details.cached_tokens is not None:
                    rec.cached_tokens = details.cached_tokens
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
    client = openai_client(url)
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


async def run_agent(url: str, model: str, system: str, sessions: list[AgentSession]):
    """Every session at once, its turns one after another (each turn's messages: the system
    prompt, the task, then per earlier turn the model's own answer and the next tool result).
    Records in (session, turn) order and the wall time."""
    client = openai_client(url)
    t0 = time.perf_counter()

    async def session(s: AgentSession) -> list[Record]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": s.task}]
        recs = []
        for k, max_tokens in enumerate(s.max_tokens):
            if k:
                messages += [{"role": "assistant", "content": recs[-1].text},
                             {"role": "user", "content": "Tool result:\n" + s.tool_results[k - 1] + "\nWhat next?"}]
            rec = await one_request(client, model, list(messages), max_tokens)
            recs.append(rec)
            if rec.error:  # the session cannot go on; keep (session, turn) alignment for agreement
                recs += [Record(max_tokens=m, error="skipped: an earlier turn failed") for m in s.max_tokens[k + 1:]]
                break
        return recs

    try:
        per = await asyncio.gather(*(session(s) for s in sessions))
    finally:
        await client.close()
    return [r for recs in per for r in recs], time.perf_counter() - t0


# ---- numbers -----------------------------------------------------------------------------------
def run_stats(records: list[Record], wall: float, trace: list[Item] | None = None) -> dict:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.ttft and r.completion_tokens > 1]
    return {
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "short_outputs": sum(r.completion_tokens < r.max_tokens for r in ok),
        "prompt_tokens": prompt,
        "cached_tokens_usage": sum(cached) if cached else None,
        "prefix_hit_rate_usage": round(sum(cached) / prompt, 4) if cached and prompt else None,
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "req_s": round(len(ok) / wall, 4),
        "ttft_p50_ms": scaled(percentile(ttfts, 50), 1000),
        "ttft_p90_ms": scaled(percentile(ttfts, 90), 1000),
        "itl_p50_ms": scaled(percentile(gaps, 50), 1000),
        "tpot_p50_ms": scaled(percentile(tpots, 50), 1000),
        "e2e_p50_s": scaled(percentile([r.e2e for r in ok], 50), 1, 2),
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
        "ttft_p50_ms": scaled(percentile(pool["_ttfts"], 50), 1000),
        "ttft_p90_ms": scaled(percentile(pool["_ttfts"], 90), 1000),
        "itl_p50_ms": scaled(percentile(pool["_gaps"], 50), 1000),
        "tpot_p50_ms": scaled(percentile(pool["_tpots"], 50), 1000),
        "errors": sum(r["errors"] for r in runs),
        "short_outputs": sum(r["short_outputs"] for r in runs),
        "disturbed_runs": sum(bool(r.get("disturbed")) for r in runs),
        "prefix_hit_rate_usage": _ratio(sum(r["cached_tokens_usage"] or 0 for r in runs),
                                        sum(r["prompt_tokens"] for r in runs)) if any(
            r["cached_tokens_usage"] is not None for r in runs) else None,
        "prefix_hit_rate_server": _ratio(sum(r.get("server_prefix", {}).get("hits", 0) for r in runs),
                                         sum(r.get("server_prefix", {}).get("queries", 0) for r in runs)),
        "foreign_cores_runs": [r["cpu_cores"]["foreign"] for r in runs if "cpu_cores" in r],
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def agreement(a: list[Record], b: list[Record]) -> tuple[int, float]:
    """(identical outputs, mean share of the shorter text that is a common prefix)."""
    same, shares = 0, []
    for x, y in zip(a, b):
        same += x.error is None and y.error is None and x.text == y.text
        n = min(len(x.text), len(y.text))
        k = next((i for i in range(n) if x.text[i] != y.text[i]), n)
        shares.append(k / n if n else 0.0)
    return same, round(statistics.fmean(shares), 3) if shares else 0.0
