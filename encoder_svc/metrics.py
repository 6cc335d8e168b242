"""Prometheus metrics of one encoder app, in a per-app ``CollectorRegistry``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class EncoderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "encoder_requests", "encode requests by outcome", ["modality", "status"], registry=r
        )
        self.latency = Histogram("encoder_request_seconds", "encode latency", ["modality"], registry=r)
        self.forwards = Counter(
            "encoder_forward_passes", "model forward passes (one per fused batch)", ["encoder"], registry=r
        )
        self.forward_items = Counter(
            "encoder_forward_items", "items (images, frames, audio windows) run through a forward",
            ["encoder"], registry=r,
        )
        self.batch_size = Histogram(
            "encoder_batch_size", "items per fused forward", ["encoder"], buckets=_SIZE_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "encoder_queue_wait_seconds", "time an item waited before its forward started",
            ["encoder"], buckets=_WAIT_BUCKETS, registry=r,
        )
        self.forward_errors = Counter(
            "encoder_forward_errors", "failed forward passes", ["encoder"], registry=r
        )
        self.cache_lookups = Counter(
            "encoder_cache_lookups", "embedding cache lookups", ["tier", "modality", "result"], registry=r
        )
        self.cache_bytes = Gauge("encoder_cache_bytes", "bytes held by a cache tier", ["tier"], registry=r)
        self.cache_errors = Counter(
            "encoder_cache_errors", "cache tier failures (degraded, not failed)", ["tier"], registry=r
        )
        # values read back from Redis whose HMAC did not check out (planted or moved): misses
        self.peer_auth_failures = Counter(
            "mmserve_peer_auth_failures", "values read from Redis whose HMAC under the peer key did not check out "
            "(never used: a miss)", ["source"], registry=r
        )
        self.peer_auth_failures.labels("embedding")

        self.overload_rejections = Counter(
            "encoder_overload_rejections", "encode requests answered 429 by admission control", registry=r
        )
        self.deadline_drops = Counter(
            "encoder_deadline_drops", "encode work dropped because its request's deadline passed", registry=r
        )
        self.cancelled_encodes = Counter(
            "encoder_cancelled_encodes", "encodes cancelled because every request waiting for them had gone",
            registry=r,
        )
        self.admitted_in_flight = Gauge("encoder_admitted_in_flight", "encode requests holding a slot", registry=r)
        self.admission_queued = Gauge("encoder_admission_queued", "encode requests waiting for a slot", registry=r)

    def watch_admission(self, admission) -> None:
        self.admitted_in_flight.set_function(lambda: admission.in_flight)
        self.admission_queued.set_function(lambda: admission.queued)

    def render(self) -> bytes:
        return generate_latest(self.registry)
