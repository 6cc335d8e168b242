"""Prometheus metrics of one gateway app (own registry, so several apps can share a process)
and the ASGI middleware that counts requests, latency and in-flight requests."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.malloc_tuning import heap_gauge

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """The gateway's Prometheus series, registered in a registry owned by this object."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mmserve_gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "mmserve_gateway_request_seconds", "request latency (stream: until the last byte)",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "mmserve_gateway_ttft_seconds", "time to first streamed token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("mmserve_gateway_in_flight_requests", "requests being served", registry=r)
        self.media_items = Counter(
            "mmserve_gateway_media_items", "media items received by modality", ["modality"], registry=r
        )
        self.llm_body_bytes = Counter(
            "mmserve_gateway_llm_body_bytes", "bytes of /v1/generate bodies sent to LLM replicas", registry=r
        )
        self.media_sent = Counter(
            "mmserve_gateway_media_sent", "media items sent to the LLM, by how (ref: key only, value: tensor)",
            ["how"], registry=r,
        )
        self.media_resends = Counter(
            "mmserve_gateway_media_resends", "requests re-sent by value after the LLM could not fetch by reference",
            registry=r,
        )
        self.encoder_retries = Counter(
            "mmserve_gateway_encoder_failovers", "encode attempts retried on another replica", registry=r
        )
        # KV events read from Redis whose HMAC under the peer key did not check out: ignored
        self.peer_auth_failures = Counter(
            "mmserve_peer_auth_failures", "values read from Redis whose HMAC under the peer key did not check out "
            "(never used)", ["source"], registry=r
        )
        self.peer_auth_failures.labels("kv_event")

        self.rejected = Counter(
            "mmserve_gateway_overload_rejections", "requests answered 429 by admission control, by who refused",
            ["by"], registry=r,
        )
        self.admission_in_flight = Gauge(
            "mmserve_gateway_admitted_in_flight", "chat requests holding an admission slot", registry=r
        )
        self.admission_queued = Gauge(
            "mmserve_gateway_admission_queued", "chat requests waiting for an admission slot", registry=r
        )

        heap_gauge("mmserve_gateway_malloc_bytes", r)

    def watch_router(self, router) -> None:
        """A gauge of the LLM router's prefix index (bounded by ``router_index_blocks``)."""
        Gauge("mmserve_gateway_router_index_blocks", "prefix block keys the LLM router remembers",
              registry=self.registry).set_function(router.index_blocks)

    def watch_kv_feed(self, feed) -> None:
        """Gauges of the KV-event index: whether it is followed, its keys, events and snapshots."""
        for name, doc, fn in (
            ("mmserve_gateway_kv_events_connected", "1 while the LLM replicas' KV events are followed",
             lambda: float(feed.connected)),
            ("mmserve_gateway_kv_index_keys", "router keys the LLM replicas report they hold", lambda: feed.index.total),
            ("mmserve_gateway_kv_events_read", "KV events folded into the index", lambda: feed.events),
            ("mmserve_gateway_kv_snapshots", "replica KV snapshots loaded", lambda: feed.snapshots),
        ):
            Gauge(name, doc, registry=self.registry).set_function(fn)
        feed.on_auth_failure = self.peer_auth_failures.labels("kv_event").inc

    def watch_replicas(self, **services) -> None:
        """Per service (``name=(pool, client)``), read at scrape time: each replica's state
        (``mmserve_gateway_replica_up``: 1 routable, 0 out of rotation; ``lost`` 1 when it gives no
        answer at all) and the waits on replicas ended because they were lost."""

        class _Replicas:
            def collect(self):
                up = GaugeMetricFamily("mmserve_gateway_replica_up", "1 while a replica is in rotation",
                                       labels=["service", "replica"])
                lost = GaugeMetricFamily("mmserve_gateway_replica_lost", "1 while a replica answers no probe at all",
                                         labels=["service", "replica"])
                ended = CounterMetricFamily("mmserve_gateway_upstream_lost",
                                            "requests' waits on a replica ended because it stopped answering: "
                                            "before_answer (retried elsewhere), mid_answer (answered with an error)",
                                            labels=["service", "when"])
                for name, (pool, client) in services.items():
                    healthy, gone = set(pool.healthy()), set(pool.lost())
                    for r in pool.replicas():
                        up.add_metric([name, r], float(r in healthy))
                        lost.add_metric([name, r], float(r in gone))
                    for when, n in client.waits.lost.items():
                        ended.add_metric([name, when], n)
                yield from (up, lost, ended)

        self.registry.register(_Replicas())

    def watch_pairing(self, pairing) -> None:
        """Prefill / decode pairing (docs/disagg.md), read at scrape time: requests by decision
        (remote: prefilled on a prefill replica; local_*: on their decode replica, and why) and
        each prefill replica's state."""

        class _Pairing:
            def collect(self):
                dec = CounterMetricFamily("mmserve_gateway_disagg_decisions", "requests by prefill / decode pairing "
                                          "decision (remote; local_short, local_cached, local_busy, local_no_prefill)",
                                          labels=["decision"])
                for d, n in pairing.decisions.items():
                    dec.add_metric([d], n)
                up = GaugeMetricFamily("mmserve_gateway_prefill_replica_up", "1 while a prefill replica is in rotation",
                                       labels=["replica"])
                healthy = set(pairing.pool.healthy())
                for r in pairing.pool.replicas():
                    up.add_metric([r], float(r in healthy))
                yield from (dec, up)

        self.registry.register(_Pairing())

    def watch_admission(self, admission) -> None:
        """Gauges read the gate's counters at scrape time."""
        self.admission_in_flight.set_function(lambda: admission.in_flight)
        self.admission_queued.set_function(lambda: admission.queued)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI (streams pass through untouched); unknown paths are labelled ``other``."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 500
        start = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.monotonic() - start)
