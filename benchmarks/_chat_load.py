"""The load client of the benchmarks that drive a server: seeded traces of random pseudo-word
prompts with exact token counts (single chats, and multi-turn agent sessions that share one
system prompt and grow by each answer plus a tool result), the client factories
(``openai_client`` for the OpenAI endpoints, ``http_client`` for the others, e.g. the
encoder's ``/v1/encode``), a streaming chat request that times every content chunk and reads the
usage chunk (completion and cached prompt tokens), the one load driver (``drive``: n requests,
each an awaitable the caller supplies, at a fixed concurrency or at given arrival times, results
in request order; ``closed_loop``: N workers each sending its next turn as soon as the last one
ends, until told to stop — ``drive`` at a fixed concurrency runs on it), the chat loads built on
them (``run_load``, ``run_agent``) and the numbers (tok/s, TTFT / ITL / TPOT percentiles from
``benchmarks._stats``, prefix-cache hit rate, greedy agreement between two servers)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
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


def http_client(url: str, timeout: float = 300, max_connections: int | None = None) -> httpx.AsyncClient:
    """The client for a server's non-OpenAI endpoints: paths relative to ``url``, no retries (as
    httpx: none), at most ``max_connections`` open connections (None: httpx's default, 100)."""
    limits = httpx.Limits() if max_connections is None else httpx.Limits(max_connections=max_connections)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


# ---- driver ------------------------------------------------------------------------------------
T = TypeVar("T")


async def closed_loop(workers: int, turn: Callable[[int, int], Awaitable[None]], done: Callable[[], bool]) -> None:
    """``workers`` closed loops at once: worker ``k`` awaits ``turn(k, i)`` for i = 0, 1, ...,
    each as soon as the one before ends, until ``done()`` (asked before every turn)."""

    async def worker(k: int) -> None:
        i = 0
        while not done():
            await turn(k, i)
            i += 1

    await asyncio.gather(*(worker(k) for k in range(workers)))


async def drive(n: int, send: Callable[[int], Awaitable[T]], concurrency: int | None = None,
                arrivals: Sequence[float] | None = None) -> tuple[list[T], float]:
    """Await ``send(i)`` for i = 0 .. n-1; return the results in index order (the per-request
    records, whatever ``send`` returns) and the wall time, first send -> last answer.

    ``concurrency``: at most this many in flight, started in index order, each as soon as one
    ends (a closed loop of that many workers over the shared index); None: no cap.
    ``arrivals`` (seconds from the start, one per request): open loop, request i is sent at
    ``arrivals[i]`` (at once when that has passed), whatever is still in flight; with a
    ``concurrency`` too, a request that arrives when the cap is reached waits for a slot.
    An exception out of ``send`` ends the run with it (a failed request a benchmark counts is
    a result ``send`` returns)."""
    if arrivals is not None and len(arrivals) != n:
        raise ValueError(f"{len(arrivals)} arrival times for {n} requests")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    results: list = [None] * n
    t0 = time.perf_counter()
    if arrivals is None:
        nxt = 0

        async def turn(k: int, i: int) -> None:
            nonlocal nxt
            j, nxt = nxt, nxt + 1
            results[j] = await send(j)

        await closed_loop(min(concurrency or n, n), turn, lambda: nxt >= n)
    else:
        sem = asyncio.Semaphore(concurrency or max(n, 1))

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with sem:
                results[i] = await send(i)

        await asyncio.gather(*(one(i) for i in range(n)))
    return results, time.perf_counter() - t0


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
    usage: bool = False  # the stream ended with a usage chunk


async def one_request(client: openai.AsyncOpenAI, model: str, item: Item | list[dict], max_tokens: int = 0,
                      ignore_eos: bool = True) -> Record:
    """One streamed greedy chat completion: ``item`` (one user message) or a message list with
    ``max_tokens``; ``ignore_eos`` (sent as an extra body field): every answer is ``max_tokens``
    long. An API error is the record's ``error``, not raised."""
    messages = [{"role": "user", "content": item.prompt}] if isinstance(item, Item) else item
    max_tokens = item.max_tokens if isinstance(item, Item) else max_tokens
    rec, pieces = Record(max_tokens=max_tokens), []
    t0 = last = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if ignore_eos else None,
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                rec.usage = True
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
    try:
        return await drive(len(trace), lambda i: one_request(client, model, trace[i]), concurrency, arrivals)
    finally:
        await client.close()


async def run_agent(url: str, model: str, system: str, sessions: list[AgentSession]):
    """Every session at once, its turns one after another (each turn's messages: the system
    prompt, the task, then per earlier turn the model's own answer and the next tool result).
    Records in (session, turn) order and the wall time."""
    client = openai_client(url)

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
        per, wall = await drive(len(sessions), lambda i: session(sessions[i]))
    finally:
        await client.close()
    return [r for recs in per for r in recs], wall


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
