"""Prometheus metrics of one LLM service app (its own CollectorRegistry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .types import BackendStats


class LLMMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mmserve_llm_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("mmserve_llm_rejected_requests", "Requests refused with 4xx/5xx", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("mmserve_llm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("mmserve_llm_generation_tokens", "Generated tokens", registry=r)
        self.prefix_hit_tokens = Counter("mmserve_llm_prefix_hit_tokens", "Prompt tokens served from the prefix cache",
                                         registry=r)
        self.ttft = Histogram(
            "mmserve_llm_time_to_first_token_seconds", "Time to first token", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.e2e = Histogram("mmserve_llm_request_seconds", "Request latency", registry=r,
                             buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.running = Gauge("mmserve_llm_running_requests", "Requests being generated", registry=r)
        self.waiting = Gauge("mmserve_llm_waiting_requests", "Requests waiting to start", registry=r)
        self.restarts = Gauge("mmserve_llm_engine_core_restarts", "Engine-core processes restarted by the front",
                              registry=r)
        self.kv_usage = Gauge("mmserve_llm_kv_pool_usage", "Fraction of a KV pool in use", ["pool"], registry=r)

    def render(self, stats: BackendStats) -> bytes:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.restarts.set(stats.engine_restarts)
        self.kv_usage.labels(pool="full").set(stats.kv_full_usage)
        self.kv_usage.labels(pool="swa").set(stats.kv_swa_usage)
        return generate_latest(self.registry)
