"""Prometheus metrics of one LLM service app (its own CollectorRegistry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.malloc_tuning import heap_gauge
from shared.settings import LLM_ROLES

from llm_svc.types.request import BackendStats

MEDIA_SOURCES = ("redis", "http")
PEER_SOURCES = ("kv_page", "embedding")


class LLMMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        heap_gauge("mmserve_llm_malloc_bytes", r)  # the front process (the engine core is another)
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
        self.itl = Histogram(
            "mmserve_llm_inter_token_latency_seconds", "Time between consecutive output tokens", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.e2e = Histogram("mmserve_llm_request_seconds", "Request latency", registry=r,
                             buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        # media by reference: each item sent by key is fetched (a span past the cached prefix),
        # skipped (the prefix cache covered it) or missed (no encoder had it: the request got a 409)
        self.media_refs = Counter("mmserve_llm_media_refs", "Media items sent by reference, by outcome",
                                  ["outcome"], registry=r)
        self.media_bytes = Counter("mmserve_llm_media_fetch_bytes", "Bytes of embeddings fetched from encoders",
                                   registry=r)
        # where each fetched item was read: the encoders' Redis tier (--media-redis-url) or
        # GET {encoder}/v1/embeddings/{key}; beside media_refs so its outcome series stay as they were
        self.media_sources = Counter("mmserve_llm_media_fetch_source", "Media items fetched by reference, by where "
                                     "they were read (redis: the encoders' Redis tier; http: an encoder)",
                                     ["source"], registry=r)
        for source in MEDIA_SOURCES:
            self.media_sources.labels(source)  # both series exported from the start, at 0
        # values read back from Redis whose HMAC under the peer key did not check out: misses, never
        # used (embedding: counted here; kv_page: the engine core's l3_auth_failures, folded in by render)
        self.peer_auth_failures = Counter("mmserve_peer_auth_failures", "Values read from Redis whose HMAC under the "
                                          "peer key did not check out (never used: a miss)", ["source"], registry=r)
        for source in PEER_SOURCES:
            self.peer_auth_failures.labels(source)
        self._core_auth_failures = 0  # the core's count when last folded in
        self.deadline_drops = Counter("mmserve_llm_deadline_drops", "Requests stopped because their deadline passed",
                                      registry=r)
        # prefill / decode disaggregation (docs/disagg.md): 1 on this replica's role, 0 on the others
        self.role = Gauge("mmserve_llm_role", "This replica's role: prefill, decode or both (1 on its own)",
                          ["role"], registry=r)
        self.set_role("both")
        self.remote_prefill = Counter("mmserve_llm_remote_prefill", "Requests a decode replica had prefilled "
                                      "elsewhere, by outcome (handed_over; finished: the first token ended it; "
                                      "fallback_*: prefilled here instead)", ["outcome"], registry=r)
        self.handover = Gauge("mmserve_llm_handover", "Prefill / decode hand-overs of the engine core (cumulative "
                              "since it started): sent, received, adopted, bytes, send_ms, fallback_<reason>, ...",
                              ["event"], registry=r)
        self.admitted = Gauge("mmserve_llm_admitted_in_flight", "Requests holding an admission slot", registry=r)
        self.running = Gauge("mmserve_llm_running_requests", "Requests being generated", registry=r)
        self.waiting = Gauge("mmserve_llm_waiting_requests", "Requests waiting to start", registry=r)
        self.restarts = Gauge("mmserve_llm_engine_core_restarts", "Engine-core processes restarted by the front",
                              registry=r)
        self.kv_usage = Gauge("mmserve_llm_kv_pool_usage", "Fraction of a KV pool in use (full, swa; host_full, "
                              "host_swa: the host tier, held by the prefix tree)", ["pool"], registry=r)
        self.tree_nodes = Gauge("mmserve_llm_kv_tree_nodes", "Nodes of the prefix tree (bounded by the pools)",
                                registry=r)
        # KV tiers (cumulative since the engine core started)
        self.tier_tokens = Gauge("mmserve_llm_kv_tier_tokens", "KV tokens moved between tiers",
                                 ["tier", "event"], registry=r)
        self.tier_bytes = Gauge("mmserve_llm_kv_tier_bytes", "KV bytes moved to/from a tier", ["tier", "direction"],
                                registry=r)
        self.tier_evictions = Gauge("mmserve_llm_kv_tier_evictions", "Evictions in a tier", ["tier", "kind"],
                                    registry=r)
        self.tier_seconds = Gauge("mmserve_llm_kv_tier_seconds", "Seconds spent on tier transfers", ["tier", "what"],
                                  registry=r)
        self.l3_events = Gauge("mmserve_llm_kv_l3_events", "L3 (Redis) lookups, hits, misses, corrupt values, "
                               "errors, skipped and dropped operations", ["event"], registry=r)
        self.l3_up = Gauge("mmserve_llm_kv_l3_up", "1 if the L3 KV store answered its last command", registry=r)
        # speculative decoding (vLLM's meanings; cumulative since the engine core started)
        self.spec_drafts = Gauge("mmserve_llm_spec_decode_num_drafts", "Drafts verified (a decode step of a request "
                                 "with at least one draft token)", registry=r)
        self.spec_draft_tokens = Gauge("mmserve_llm_spec_decode_num_draft_tokens", "Draft tokens verified",
                                       registry=r)
        self.spec_accepted = Gauge("mmserve_llm_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                   registry=r)
        self.spec_accepted_pos = Gauge("mmserve_llm_spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.spec_mean_len = Gauge("mmserve_llm_spec_decode_mean_acceptance_length", "1 + accepted / drafts: tokens "
                                   "emitted per verified draft (0 before the first)", registry=r)

    def watch_admission(self, admission) -> None:
        self.admitted.set_function(lambda: admission.in_flight)

    def set_role(self, role: str) -> None:
        for r in LLM_ROLES:
            self.role.labels(r).set(1 if r == role else 0)

    def render(self, stats: BackendStats) -> bytes:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.restarts.set(stats.engine_restarts)
        self.kv_usage.labels(pool="full").set(stats.kv_full_usage)
        self.kv_usage.labels(pool="swa").set(stats.kv_swa_usage)
        t = stats.tiers
        for key, value in t.items():
            if key.startswith("handover_"):
                self.handover.labels(key.removeprefix("handover_")).set(value)
        if "tree_nodes" in t:
            self.tree_nodes.set(t["tree_nodes"])
        for pool in ("host_full", "host_swa"):
            if t.get(f"{pool}_total"):
                self.kv_usage.labels(pool=pool).set(t.get(f"{pool}_cached", 0) / t[f"{pool}_total"])
        if t:
            for (tier, event), key in _TIER_TOKENS.items():
                self.tier_tokens.labels(tier=tier, event=event).set(t.get(key, 0))
            for (tier, d), key in _TIER_BYTES.items():
                self.tier_bytes.labels(tier=tier, direction=d).set(t.get(key, 0))
            for (tier, kind), key in _TIER_EVICTIONS.items():
                self.tier_evictions.labels(tier=tier, kind=kind).set(t.get(key, 0))
            self.tier_seconds.labels(tier="host", what="copy").set(t.get("host_load_seconds", 0))
            self.tier_seconds.labels(tier="l3", what="prefetch_timeout").set(t.get("l3_wait_seconds", 0))
            if "l3_up" in t:
                self.l3_up.set(t["l3_up"])
                self._fold_core_auth_failures(int(t.get("l3_auth_failures", 0)))
                for ev in ("lookups", "hits", "misses", "corrupt", "errors", "skipped", "dropped_writes",
                           "touches", "pages_written", "windows_written"):
                    self.l3_events.labels(event=ev).set(t.get(f"l3_{ev}", 0))
        if "spec_num_drafts" in t:
            self.spec_drafts.set(t["spec_num_drafts"])
            self.spec_draft_tokens.set(t.get("spec_num_draft_tokens", 0))
            self.spec_accepted.set(t.get("spec_num_accepted_tokens", 0))
            self.spec_mean_len.set(t.get("spec_mean_acceptance_length", 0))
            for j in range(int(t.get("spec_num_spec_tokens", 0))):
                self.spec_accepted_pos.labels(position=str(j)).set(t.get(f"spec_num_accepted_tokens_per_pos_{j}", 0))
        return generate_latest(self.registry)

    def _fold_core_auth_failures(self, core: int) -> None:
        """The engine core's cumulative count into the counter (a restarted core counts from 0)."""
        delta = core - self._core_auth_failures if core >= self._core_auth_failures else core
        if delta > 0:
            self.peer_auth_failures.labels("kv_page").inc(delta)
        self._core_auth_failures = core


_TIER_TOKENS = {
    ("device", "demoted_full"): "tree_demoted_full", ("device", "demoted_swa"): "tree_demoted_swa",
    ("host", "loaded_full"): "tree_loaded_full", ("host", "loaded_swa"): "tree_loaded_swa",
    ("l3", "ingested_full"): "l3_ingested_full", ("l3", "ingested_swa"): "l3_ingested_swa",
    ("l3", "hit_full"): "l3_hit_tokens",
}
_TIER_BYTES = {
    ("host", "in"): "host_bytes_d2h", ("host", "out"): "host_bytes_h2d",
    ("l3", "in"): "l3_bytes_written", ("l3", "out"): "l3_bytes_read",
}
_TIER_EVICTIONS = {
    ("device", "node"): "tree_node_evictions", ("device", "swa"): "tree_swa_evictions",
    ("host", "node"): "tree_host_evictions", ("host", "swa"): "tree_host_swa_evictions",
}
