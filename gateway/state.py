"""The per-app objects routes depend on, built once in the app's lifespan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

import httpx
from fastapi import Depends, Request

from gateway.media.fetch import MediaFetcher
from gateway.metrics import GatewayMetrics
from gateway.routing.capacity import ReplicaLimits
from gateway.routing.encoder_ring import EncoderRing
from gateway.routing.kv_feed import KVEventFeed
from gateway.routing.kv_index import KVIndex
from gateway.routing.llm_router import EventRouter, LLMRouter, make_router
from gateway.routing.pairing import PairingConfig, PrefillPairing
from gateway.routing.replicas import ReplicaPool, http_prober
from gateway.media.ssrf import SSRFGuard
from gateway.upstream import EncoderClient, LLMClient
from shared.admission import Admission, AdmissionConfig
from shared.peer_auth import resolve as resolve_peer_key
from shared.service_auth import token_headers
from shared.settings import GatewaySettings


DEFAULT_MODEL_NAME = "mmserve-tiny"


@dataclass
class GatewayState:
    """Everything a request needs: settings, metrics, HTTP clients, replica pools, the encoder
    and LLM clients and the media fetcher.  ``build`` wires them; ``start`` / ``close`` run and
    stop the background replica refresh."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    http: httpx.AsyncClient  # encoders and LLMs
    fetch_http: httpx.AsyncClient  # client media URLs (no env proxies, no auto-redirects)
    encoder_pool: ReplicaPool
    llm_pool: ReplicaPool
    encoders: EncoderClient
    llms: LLMClient
    fetcher: MediaFetcher
    llm_limits: ReplicaLimits
    admission: Admission
    kv_feed: KVEventFeed | None = None  # the LLM replicas' KV events, with kv_events_url
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        """The served name: the setting, else what the LLM replicas report, else the default."""
        if self.settings.model_name:
            return self.settings.model_name
        served = sorted(set(self.llm_limits.models.values()))
        return served[0] if served else DEFAULT_MODEL_NAME

    @classmethod
    def build(cls, settings: GatewaySettings, metrics: GatewayMetrics) -> "GatewayState":
        s = settings
        http = httpx.AsyncClient(
            timeout=httpx.Timeout(s.request_timeout, connect=s.connect_timeout),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                keepalive_expiry=s.upstream_keepalive_expiry),
            trust_env=False,
            headers=token_headers(s.service_token),  # encoders and LLMs may require it
        )
        fetch_http = httpx.AsyncClient(
            timeout=httpx.Timeout(s.fetch_timeout),
            follow_redirects=False,
            trust_env=False,
            headers={"user-agent": "mmserve-gateway"},
        )
        prober = http_prober(http, timeout=min(2.0, s.connect_timeout))
        llm_limits = ReplicaLimits()
        llm_prober = http_prober(http, timeout=min(2.0, s.connect_timeout), on_ready=llm_limits.record)
        threshold = s.health_fail_threshold
        encoder_pool = ReplicaPool("encoder", s.encoder_urls, prober=prober, fail_threshold=threshold)
        llm_pool = ReplicaPool("llm", s.llm_urls, prober=llm_prober, fail_threshold=threshold)
        ring = EncoderRing()
        encoder_pool.on_change(lambda: ring.set_nodes(encoder_pool.routable()))
        timeout = httpx.Timeout(s.request_timeout, connect=s.connect_timeout)
        encoders = EncoderClient(
            http, encoder_pool, ring, attempts=s.upstream_attempts, timeout=timeout,
            on_failover=metrics.encoder_retries.inc, load_factor=s.encoder_load_factor,
            max_request_video_pixels=s.max_request_video_pixels,
        )
        router, kv_feed = cls._router(s, http, llm_pool, llm_limits)
        pairing = None
        if s.prefill_urls:  # prefill / decode disaggregation: docs/disagg.md
            prefill_pool = ReplicaPool("llm-prefill", s.prefill_urls, prober=prober, fail_threshold=threshold)
            pairing = PrefillPairing(prefill_pool, make_router("cache_aware", s.router_index_blocks),
                                     PairingConfig(s.disagg_min_prompt_tokens, s.disagg_max_cached_fraction,
                                                   s.disagg_max_prefill_queue, s.disagg_idle_min_prompt_tokens))
        llms = LLMClient(http, llm_pool, router, attempts=s.upstream_attempts, timeout=timeout, limits=llm_limits,
                         pairing=pairing)
        fetcher = MediaFetcher(
            fetch_http, SSRFGuard(s.allowed_hosts),
            max_bytes=s.max_media_bytes, timeout=s.fetch_timeout, max_redirects=s.max_redirects,
        )
        admission = Admission(AdmissionConfig(s.max_in_flight, s.max_queue, s.queue_timeout), "gateway")
        metrics.watch_admission(admission)
        metrics.watch_router(llms.router)
        metrics.watch_replicas(encoder=(encoder_pool, encoders), llm=(llm_pool, llms))
        if pairing is not None:
            metrics.watch_pairing(pairing)
        if kv_feed is not None:
            metrics.watch_kv_feed(kv_feed)
        return cls(s, metrics, http, fetch_http, encoder_pool, llm_pool, encoders, llms, fetcher, llm_limits,
                   admission, kv_feed)

    @staticmethod
    def _router(s: GatewaySettings, http: httpx.AsyncClient, pool: ReplicaPool,
                limits: ReplicaLimits) -> tuple[LLMRouter, KVEventFeed | None]:
        """The LLM router: on the replicas' KV events when ``kv_events_url`` is set (cache-aware
        routing only), else the policy's router on this gateway's own record."""
        if not s.kv_events_url or s.llm_routing != "cache_aware":
            return make_router(s.llm_routing, s.router_index_blocks), None

        def replicas() -> dict[str, str]:
            current = set(pool.replicas())
            return {inst: url for url, inst in limits.instances.items() if url in current}

        feed = KVEventFeed(s.kv_events_url, s.kv_events_stream, KVIndex(), http, replicas,
                           timeout=min(2.0, s.connect_timeout),
                           peer=resolve_peer_key(s.peer_key, [s.kv_events_url], "MMSERVE_GATEWAY_PEER_KEY"))

        def held(replica: str, blocks) -> int | None:
            inst = limits.instances.get(replica)
            return feed.index.match_len(inst, blocks) if feed.live(inst) else None

        return EventRouter(held, s.router_recent_s, s.router_index_blocks), feed

    def start(self) -> None:
        """Background DNS refresh and health probes of both pools."""
        s = self.settings
        pools = [self.encoder_pool, self.llm_pool]
        if self.llms.pairing is not None:
            pools.append(self.llms.pairing.pool)
        for pool in pools:
            self.tasks.append(asyncio.create_task(pool.run(s.health_interval, s.dns_interval)))
        if self.kv_feed is not None:
            self.tasks.append(asyncio.create_task(self.kv_feed.run()))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.http.aclose()
        await self.fetch_http.aclose()


async def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


StateDep = Annotated[GatewayState, Depends(get_state)]
