"""The live dashboard's data: every replica's ``/metrics`` scraped and reduced to one JSON.

``GET /dashboard/data`` answers ``DashboardSnapshot``-shaped JSON (built here); the page
(``gateway/static/dashboard.html``) polls it. Numbers are the services' own Prometheus series,
read with ``prometheus_client``'s parser, never recomputed from anything else, so what the page
shows can be checked against ``/metrics`` directly:

* LLM replica: KV pool use (``mmserve_llm_kv_pool_usage{pool=full|swa}``), running / waiting
  requests, prefix hit rate (``prefix_hit_tokens / prompt_tokens``), TTFT and inter-token
  latency histograms; with speculative decoding, draft acceptance (``num_accepted_tokens /
  num_draft_tokens``) and mean acceptance length (``1 + accepted / drafts``, vLLM's);
* encoder replica: embedding cache hit rate (hits / lookups over every tier), mean fused batch
  size (``forward_items / forward_passes``) and the batch-size histogram, queue wait;
* gateway: requests in flight, TTFT histogram;
* warnings: what the gateway and each replica leave open (their ``/readyz`` ``warnings``: no API
  key or service token while listening beyond loopback), each naming the setting that closes it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]


def parse_metrics(text: str) -> Samples:
    """Prometheus text -> samples by name (``_bucket`` / ``_count`` / ``_sum`` kept apart)."""
    out: Samples = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus gives them: ``le[i]`` upper bounds (the last is +Inf)."""

    le: list[float] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    count: float = 0.0
    sum: float = 0.0

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q`` (None without observations)."""
        if self.count <= 0:
            return None
        for le, c in zip(self.le, self.cumulative):
            if c >= q * self.count:
                return le
        return self.le[-1] if self.le else None


def histogram(samples: Samples, name: str) -> Histogram:
    """``name``'s buckets summed over every other label (e.g. every encoder of a replica)."""
    by_le: dict[float, float] = defaultdict(float)
    for lab, v in samples.get(f"{name}_bucket", []):
        by_le[float(lab["le"])] += v
    les = sorted(by_le)
    return Histogram(les, [by_le[x] for x in les], total(samples, f"{name}_count"), total(samples, f"{name}_sum"))


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


@dataclass
class LLMReplica:
    url: str
    up: bool
    kv_full_usage: float = 0.0
    kv_swa_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    prompt_tokens: float = 0.0
    prefix_hit_tokens: float = 0.0
    prefix_hit_rate: float | None = None
    generation_tokens: float = 0.0
    spec_drafts: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted_tokens: float = 0.0
    spec_acceptance_rate: float | None = None  # None: no speculation (or no draft yet)
    spec_mean_acceptance_length: float | None = None
    role: str = "both"  # prefill / decode / both (docs/disagg.md)
    handovers: float = 0.0  # hand-overs sent (prefill) or continued from (decode)
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)

    @classmethod
    def from_samples(cls, url: str, s: Samples) -> "LLMReplica":
        prompt, hits = total(s, "mmserve_llm_prompt_tokens_total"), total(s, "mmserve_llm_prefix_hit_tokens_total")
        drafts, drafted = total(s, "mmserve_llm_spec_decode_num_drafts"), total(s, "mmserve_llm_spec_decode_num_draft_tokens")
        accepted = total(s, "mmserve_llm_spec_decode_num_accepted_tokens")
        return cls(
            url=url, up=True,
            kv_full_usage=total(s, "mmserve_llm_kv_pool_usage", pool="full"),
            kv_swa_usage=total(s, "mmserve_llm_kv_pool_usage", pool="swa"),
            running=total(s, "mmserve_llm_running_requests"),
            waiting=total(s, "mmserve_llm_waiting_requests"),
            prompt_tokens=prompt, prefix_hit_tokens=hits, prefix_hit_rate=_rate(hits, prompt),
            generation_tokens=total(s, "mmserve_llm_generation_tokens_total"),
            spec_drafts=drafts, spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
            spec_acceptance_rate=_rate(accepted, drafted),
            spec_mean_acceptance_length=1.0 + accepted / drafts if drafts > 0 else None,
            role=next((lab["role"] for lab, v in s.get("mmserve_llm_role", []) if v == 1), "both"),
            handovers=total(s, "mmserve_llm_handover", event="sent") + total(s, "mmserve_llm_handover", event="adopted"),
            ttft=histogram(s, "mmserve_llm_time_to_first_token_seconds"),
            itl=histogram(s, "mmserve_llm_inter_token_latency_seconds"),
        )  # fmt: skip


@dataclass
class EncoderReplica:
    url: str
    up: bool
    cache_lookups: float = 0.0
    cache_hits: float = 0.0
    cache_hit_rate: float | None = None
    forward_passes: float = 0.0
    forward_items: float = 0.0
    mean_batch_size: float | None = None
    batch_size: Histogram = field(default_factory=Histogram)
    queue_wait: Histogram = field(default_factory=Histogram)

    @classmethod
    def from_samples(cls, url: str, s: Samples) -> "EncoderReplica":
        lookups, hits = total(s, "encoder_cache_lookups_total"), total(s, "encoder_cache_lookups_total", result="hit")
        passes, items = total(s, "encoder_forward_passes_total"), total(s, "encoder_forward_items_total")
        return cls(
            url=url, up=True, cache_lookups=lookups, cache_hits=hits, cache_hit_rate=_rate(hits, lookups),
            forward_passes=passes, forward_items=items, mean_batch_size=_rate(items, passes),
            batch_size=histogram(s, "encoder_batch_size"), queue_wait=histogram(s, "encoder_queue_wait_seconds"),
        )


@dataclass
class GatewayView:
    in_flight: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)


@dataclass
class DashboardSnapshot:
    time: float
    gateway: GatewayView
    llm: list[LLMReplica]
    encoder: list[EncoderReplica]
    # what the gateway and each replica leave open (their /readyz ``warnings``), shown as a banner
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return _finite(asdict(self))


def _finite(x):
    """JSON has no Infinity: the +Inf bucket bound becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


async def _scrape(http: httpx.AsyncClient, url: str, timeout: float) -> Samples | None:
    try:
        r = await http.get(f"{url}/metrics", timeout=timeout)
        r.raise_for_status()
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None  # a replica that does not answer shows as down; the page keeps polling


async def _warnings(http: httpx.AsyncClient, url: str, timeout: float) -> list[str]:
    """A replica's /readyz ``warnings``, each prefixed with its address (none if it does not answer)."""
    try:
        body = (await http.get(f"{url}/readyz", timeout=timeout)).json()
    except (httpx.HTTPError, ValueError):
        return []
    found = body.get("warnings") if isinstance(body, dict) else None
    return [f"{url}: {w}" for w in found if isinstance(w, str)] if isinstance(found, list) else []


async def snapshot(
    http: httpx.AsyncClient, llm_urls: list[str], encoder_urls: list[str], gateway_text: str, timeout: float = 2.0,
    gateway_warnings: list[str] = (),
) -> DashboardSnapshot:
    """Scrape every replica concurrently and reduce each to its dashboard view; ``warnings``:
    the gateway's own (``gateway_warnings``), then every replica's."""
    urls = [*llm_urls, *encoder_urls]
    scraped, warned = await asyncio.gather(asyncio.gather(*(_scrape(http, u, timeout) for u in urls)),
                                           asyncio.gather(*(_warnings(http, u, timeout) for u in urls)))
    llm_s, enc_s = scraped[: len(llm_urls)], scraped[len(llm_urls):]
    g = parse_metrics(gateway_text)
    return DashboardSnapshot(
        time=time.time(),
        gateway=GatewayView(total(g, "mmserve_gateway_in_flight_requests"), histogram(g, "mmserve_gateway_ttft_seconds")),
        llm=[LLMReplica.from_samples(u, s) if s is not None else LLMReplica(u, False) for u, s in zip(llm_urls, llm_s)],
        encoder=[EncoderReplica.from_samples(u, s) if s is not None else EncoderReplica(u, False)
                 for u, s in zip(encoder_urls, enc_s)],
        warnings=[*gateway_warnings, *(w for ws in warned for w in ws)],
    )
