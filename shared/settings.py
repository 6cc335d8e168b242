"""Per-service settings from environment variables, one prefix per service.

* gateway: ``MMSERVE_GATEWAY_*``   * encoder: ``MMSERVE_ENCODER_*``   * llm: ``MMSERVE_LLM_*``

CLI flags of ``mmserve <service>`` override the environment (they are passed as init kwargs).
"""

from __future__ import annotations

import json

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator
from typing import Annotated, Literal

from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

StrList = Annotated[list[str], NoDecode]


def _redis_url(url: str) -> str:
    """``redis://...`` (one Redis) or ``redis+cluster://h1:p1,h2:p2`` (a Redis Cluster): every
    service builds its clients in ``shared.redis_client``; a malformed cluster URL fails here."""
    from shared.redis_client import is_cluster, parse_cluster_url

    if is_cluster(url):
        parse_cluster_url(url)
    return url


# a Redis setting: redis://host:port/db, or redis+cluster://host:port[,host:port...] for a Redis Cluster
RedisURL = Annotated[str, AfterValidator(_redis_url)]


LENGTH_BUCKETS = {"short": (0, 64 * 1024), "medium": (64 * 1024, 256 * 1024), "long": (256 * 1024, 1024 * 1024)}


def length_bucket_range(label: str) -> tuple[int, int]:
    """``short`` / ``medium`` / ``long`` (Xiaomi's default ranges) or ``LO-HI`` -> [lo, hi) tokens."""
    if label in LENGTH_BUCKETS:
        return LENGTH_BUCKETS[label]
    lo, sep, hi = label.partition("-")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or int(lo) >= int(hi):
        raise ValueError(f"length bucket {label!r}: use short, medium, long or LO-HI tokens with LO < HI")
    return int(lo), int(hi)


# prefill / decode disaggregation (issue 48): what one LLM replica runs, and vLLM's KV-connector
# names for the same roles (kv_transfer_config's kv_role)
LLM_ROLES = ("prefill", "decode", "both")
VLLM_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


KV_TRANSPORTS = ("auto", "tcp", "nixl")


def _nixl_installed() -> bool:
    import importlib.util

    # a NIXL build (the nixl meta package alone imports none): what nixl_agent.load_nixl loads
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12", "nixl_rocm"))


def kv_transport(value: object) -> object:
    """``auto`` / ``tcp`` / ``nixl``, or vLLM's ``NixlConnector`` (its KV connector of the same role)."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower()
    v = {"nixlconnector": "nixl"}.get(v, v)
    if v not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport {value!r}: use one of {', '.join(KV_TRANSPORTS)} (or NixlConnector)")
    return v


def llm_role(value: object) -> object:
    """``prefill`` / ``decode`` / ``both``, or vLLM's ``kv_producer`` / ``kv_consumer`` /
    ``kv_both`` (same meaning); anything else is refused with the accepted names."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower().replace("-", "_")
    v = VLLM_KV_ROLES.get(v, v)
    if v not in LLM_ROLES:
        raise ValueError(f"role must be prefill, decode or both (vLLM's kv_producer, kv_consumer, kv_both), "
                         f"got {value!r}")
    return v


LLMRole = Annotated[Literal["prefill", "decode", "both"], BeforeValidator(llm_role)]
KVTransport = Annotated[Literal["auto", "tcp", "nixl"], BeforeValidator(kv_transport)]


KV_EVENTS_STREAM = "mmserve:kv-events"
THIS_MACHINE = ("127.0.0.1", "::1", "localhost")  # the allow-lists' default: peers on this machine only
KEEP_ALIVE_TIMEOUT_S = 30.0  # every service's idle keep-alive timeout (uvicorn's own default: 5 s)
UPSTREAM_KEEPALIVE_EXPIRY_S = 10.0  # the gateway's pooled connections to encoders and LLMs


class _ServiceSettings(BaseSettings):
    host: str = Field(default="127.0.0.1", description="address to listen on; 0.0.0.0: every interface")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port to listen on")
    log_level: str = Field(default="info", description="log level: critical, error, warning, info, debug, trace")
    service_token: str | None = Field(
        default=None, description="shared secret between the services (header x-mmserve-service-token): encoders and "
        "LLMs refuse callers without it (health, readiness and metrics stay open), the gateway and LLMs send it; for "
        "deployments without NetworkPolicies. Set the same value on every service"
    )
    peer_key: str | None = Field(
        default=None, min_length=16, repr=False, description="HMAC key shared by the services (the same on every "
        "one; openssl rand -hex 32): every KV page, embedding and KV event written to Redis carries a tag under it "
        "and a value whose tag does not check out is a miss (mmserve_peer_auth_failures_total). Unset: a fixed "
        "development key with a warning while every Redis is on this machine; a Redis elsewhere refuses to start"
    )
    keep_alive_timeout: float = Field(
        default=KEEP_ALIVE_TIMEOUT_S, gt=0, description="seconds an idle keep-alive connection stays open (uvicorn's "
        "timeout_keep_alive). Keep it above the callers' pool expiry (httpx and the openai client: 5 s; the gateway's "
        "upstream_keepalive_expiry: 10 s): when both are equal a caller can send on a connection the server is "
        "closing and get a reset instead of an answer"
    )


class _AsyncioHeapSettings(BaseSettings):
    """For the torch-light asyncio processes (gateway, LLM front); not the encoders, whose
    preprocessing tensors would each become a fresh mapping."""

    malloc_mmap_threshold: int = Field(
        default=128 * 1024, ge=0, description="glibc mmap threshold fixed at start (bytes) so asyncio's 256 KiB "
        "read buffers never fragment the heap (shared/malloc_tuning.py); 0 keeps glibc's dynamic threshold"
    )


class EncoderSettings(_ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="MMSERVE_ENCODER_", extra="ignore")

    port: int = Field(default=8100, ge=0, le=65535, description="TCP port to listen on")
    model_dir: str = Field(description="model bundle directory (see README: bundle format); mmserve encoder "
                           "without one: the default tiny model")
    model_name: str | None = Field(default=None, description="served name; default: dir name")
    device: str = Field(default="cpu", description="torch device of the towers: cpu, cuda or cuda:N")
    dtype: str = Field(default="float32", description="dtype of the towers: float32, bfloat16 or float16")
    max_media_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="largest media item (image, audio or video file) one encode "
        "request carries; past it a 413"
    )
    max_image_pixels: int = Field(default=64_000_000, ge=1, description="decompression-bomb guard")
    # decode budgets per item: past one a 413 naming it; each description says how its default was measured
    max_audio_samples: int = Field(
        default=57_600_000, ge=1, description="decoded audio samples x channels per item, from the stream info "
        "before decoding: an hour at the towers' 16 kHz mono, 10 min of 48 kHz stereo. Decoding that many took "
        "2.2 s and 1.1 GB peak (19 bytes a sample) on a 2-core Xeon",
    )
    max_audio_samples_per_second: int = Field(
        default=3_072_000, ge=1, description="audio sample rate x channels: 384 kHz (the highest rate recordings "
        "use) x 8 channels (7.1); the towers use 16 kHz mono, so anything above is a decompression bomb's shape",
    )
    max_video_pixels: int = Field(
        default=265_420_800, ge=1, description="decoded video pixels per item, sampled frames x width x height: 32 "
        "frames (video_max_frames) of 4K UHD. Checked from the stream info before decoding and on every decoded "
        "frame (a stream may change size); decoding 32 sampled 1080p frames of a 32 s clip took 3.4 s here",
    )
    decode_timeout_s: float = Field(
        default=30.0, gt=0, description="wall time to decode one video or audio item; past it the decode stops "
        "between frames / blocks and the item gets a 413. About 9x the 1080p clip above and 2x its 4K estimate, "
        "and under request_timeout so the client hears why",
    )
    # batching
    max_batch_size: int = Field(default=16, ge=1, description="items per tower forward")
    max_wait_ms: float = Field(
        default=5.0, ge=0, description="milliseconds a batch waits for more items before it runs below max_batch_size"
    )
    request_timeout: float = Field(
        default=120.0, gt=0, description="seconds an encode request may wait and run; past it a timeout error"
    )
    # admission control: past max_in_flight + max_queue an encode is a 429 with Retry-After
    max_in_flight: int = Field(default=64, ge=1, description="encode requests served at once")
    max_queue: int = Field(default=256, ge=0, description="encode requests waiting for a slot")
    queue_timeout: float = Field(default=30.0, gt=0, description="longest wait for a slot before a 429")
    # video
    video_backend: str = Field(default="decord", description="video decoder: decord or torchcodec")
    video_fps: float = Field(default=1.0, gt=0, description="frames sampled per second of video")
    video_max_frames: int = Field(default=32, ge=1, description="most frames sampled from one video")
    video_workers: int = Field(default=0, ge=0, description="0: one per core")
    image_backend: str = Field(
        default="torchvision", description="image decode and preprocess: torchvision, or dali (NVIDIA DALI on the "
        "GPU; pip install mmserve[dali])"
    )
    # cache
    cache_bytes: int = Field(
        default=512 * 1024 * 1024, ge=0, description="in-process LRU of embeddings, in bytes; 0 turns it off"
    )
    shm_cache_bytes: int = Field(
        default=0, ge=0, description="embedding tier in host shared memory (/dev/shm), shared by the encoders of one "
        "host, in bytes; 0 turns it off"
    )
    redis_url: RedisURL | None = Field(
        default=None, description="Redis embedding tier shared by the encoders: redis://host:port/db, or "
        "redis+cluster://host:port[,host:port...] for a Redis Cluster (same form for every Redis URL setting)"
    )
    redis_ttl_s: int = Field(default=3600, ge=1, description="seconds an embedding stays in Redis")
    redis_max_bytes: int = Field(
        default=1024 * 1024 * 1024, ge=0,
        description="largest entry stored in Redis; the total is Redis's maxmemory (allkeys-lru evicts)",
    )


class LLMSettings(_ServiceSettings, _AsyncioHeapSettings):
    model_config = SettingsConfigDict(env_prefix="MMSERVE_LLM_", extra="ignore")

    port: int = Field(default=8200, ge=0, le=65535, description="TCP port to listen on")
    model_dir: str = Field(description="model bundle or checkpoint directory; mmserve llm without one: the default "
                           "tiny model")
    model_name: str | None = Field(default=None, description="served name; default: dir name")
    backend: str = Field(default="swa", description="swa (our hybrid SWA engine) or hf (transformers reference)")
    device: str = Field(default="cpu", description="torch device of the engine: cpu, cuda or cuda:N")
    dtype: str = Field(default="float32", description="dtype of the weights: float32, bfloat16 or float16")
    max_model_len: int | None = Field(
        default=None, ge=16, description="longest prompt + output in tokens; unset: the checkpoint's context length "
        "(its text config's max_position_embeddings, as vLLM), at most what the KV pool holds",
    )
    max_request_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1, description="largest /v1/generate body (prompt + media embeddings)"
    )
    max_in_flight: int = Field(default=256, ge=1, description="requests admitted at once; past it a 429")
    trust_request_chat_template: bool = Field(
        default=False, description="render a chat template a request sends in chat_template_kwargs.chat_template "
        "(vLLM's --trust-request-chat-template); off: such a request gets a 400. A request's Jinja runs on this "
        "server's CPU: a nested loop holds it for minutes, so allow it only for callers you trust"
    )
    length_bucket: str | None = Field(
        default=None,
        description="prompt-length range this replica serves (gateway routes by it): short (0-64K), "
        "medium (64K-256K), long (256K-1M) or LO-HI in tokens; unset: any length",
    )

    @field_validator("length_bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        if v is not None:
            length_bucket_range(v)  # raises on a bad label
        return v
    role: LLMRole = Field(
        default="both", description="prefill / decode disaggregation (docs/disagg.md): prefill (run prompts to their "
        "first token and hand the KV over), decode (continue requests from a hand-over), both (today's unified "
        "replica); vLLM's kv_role names kv_producer, kv_consumer, kv_both are accepted with that meaning",
    )
    handover_host: str = Field(
        default="127.0.0.1", description="role decode: the address the engine core receives hand-overs on, and "
        "tells prefill replicas to send them to; auto: every interface, advertising this host's own address (one "
        "replica of a scaled compose service, a pod)",
    )
    handover_port: int = Field(default=0, ge=0, le=65535, description="role decode: the hand-over port; 0 picks "
                               "a free one (shown on /readyz)")
    handover_timeout_s: float = Field(
        default=10.0, gt=0, description="role prefill: the longest a hand-over's send may take (past it the request "
        "fails with 503 and the decode replica recomputes); role decode: the longest a request waits for its "
        "announced hand-over before it recomputes the prompt (counted as timeout)",
    )
    handover_ttl_s: float = Field(default=60.0, gt=0, description="role decode: a received hand-over no request "
                                  "claims within this is dropped (counted as expired)")
    kv_transport: KVTransport = Field(
        default="auto", description="how a P/D hand-over's KV pages travel (docs/disagg.md): tcp (on the hand-over "
        "connection's stream), nixl (NVIDIA NIXL: a one-sided WRITE into a buffer the decode replica registered; "
        "pip install nixl-cu13, or nixl on a CUDA host), auto (nixl where installed, else tcp). Both ends offer and "
        "pick per connection, so a replica with NIXL still takes hand-overs from one without; vLLM's kv_connector "
        "name NixlConnector is accepted for nixl",
    )
    handover_pool_bytes: int = Field(
        default=1 << 30, ge=0, description="role decode, kv_transport nixl: receive buffers kept registered for reuse "
        "while no hand-over uses them (a fresh buffer costs its page faults on every transfer)",
    )
    kv_peer_allow: StrList = Field(
        default_factory=lambda: list(THIS_MACHINE), description="the replicas a P/D hand-over may "
        "name (docs/disagg.md): role decode calls only these as remote_prefill_url (it sends its service token "
        "there), role prefill sends KV only to these as remote_host:remote_port. Host names (resolved: a scaled "
        "service's replicas), IP addresses or networks, each optionally with :port (comma-separated or JSON list). "
        "A /v1/generate naming another gets a 400 kv_peer_not_allowed; default: this machine only",
    )
    remote_prefill_timeout_s: float = Field(
        default=600.0, gt=0, description="role decode: the longest the call to a prefill replica may take; past it, "
        "or on its failure, the prompt is prefilled here",
    )
    # swa engine
    kv_bytes: int = Field(
        default=256 * 1024 * 1024, ge=0, description="bytes of the device KV pools (full and SWA layers together) "
        "while kv_fraction is 0; per rank under tensor_parallel_size (each rank holds its heads' share)"
    )
    kv_fraction: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="the KV pools take this fraction of the device's free memory at "
        "start instead of kv_bytes; 0: kv_bytes"
    )
    swa_fraction: float | None = Field(
        default=None, gt=0.0, lt=1.0, description="share of the KV bytes for the SWA-layer pool; unset: sized from "
        "the window and the full pool (llm_svc/kv/budget.py)"
    )
    max_batch_tokens: int = Field(
        default=2048, ge=16, description="tokens per engine step (decodes + prefill chunks); vLLM's default too: 2048 "
        "gave 7-12% more throughput than 512 on a 2-core CPU (README, Engine speed)",
    )
    prefill_step_tokens: int | None = Field(
        default=None, ge=0, description="a step that already holds this many prompt tokens admits no more waiting "
        "prompts (they start next step, so prompts that arrive together finish one after another); 0: fill "
        "max_batch_tokens; unset: 256 on CPU (4 chats in flight on 2 cores, TTFT p50 193 -> 174 ms), 0 on CUDA",
    )
    max_running: int = Field(default=64, ge=1, description="sequences running at once (vLLM's --max-num-seqs)")
    enable_prefix_cache: bool = Field(
        default=True, description="reuse the KV of prompt prefixes seen before (the prefix tree); vLLM's "
        "--enable-prefix-caching"
    )
    schedule_policy: str = Field(
        default="compute_aware",
        description="admission order: compute_aware (fewest uncached tokens first, with aging) or fcfs",
    )
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="dtype of the KV pools; auto: the model's dtype"
    )
    attention_backend: str = Field(
        default="auto", description="attention kernel: auto (cpu_flash on CPU, sdpa on CUDA), cpu_flash, sdpa, "
        "triton_paged (CUDA: reads the paged pools in place), torch_batched, torch_sdpa_loop",
    )
    linear_backend: Literal["auto", "packed", "onednn", "torch"] = Field(
        default="auto", description="GEMMs of the model's linears and MLPs: auto (packed on CPU for float32 and "
        "bfloat16; on a CPU with AMX, bfloat16 calls of 16 rows or more on oneDNN's AMX GEMM; torch elsewhere), packed (our CPU float32 kernel on weights packed once, on the elastic thread "
        "pool; falls back to onednn where it cannot run), onednn (oneDNN on weights reordered once; falls back to "
        "torch where it cannot run), torch (F.linear: MKL on CPU, cuBLAS on CUDA)",
    )
    cuda_graphs: bool = Field(
        default=False, description="CUDA: decode steps of up to cuda_graph_max_batch sequences replay CUDA graphs "
        "recorded at start-up, one per batch bucket (1, 2, 4, then multiples of 8); needs attention_backend "
        "triton_paged (auto picks it); a capture that fails turns them off with a warning; ignored on the CPU",
    )
    cuda_graph_max_batch: int = Field(default=64, ge=1, description="the largest decode batch with a CUDA graph")
    warmup: bool = Field(
        default=True, description="CPU: build the oneDNN matmul primitives of every row bucket up to "
        "max_batch_tokens at start-up (about 2 s for the vs_vllm MiMo checkpoint on 2 cores), so no request pays "
        "for one (about 10 ms a prefill of a new length otherwise)",
    )
    threads: int = Field(default=0, ge=0, description="torch threads of the engine core; 0: every core on CPU (OpenMP threads sleep soon at barriers)")
    small_step_tokens: int = Field(
        default=64, ge=1, description="CPU: engine steps of fewer tokens (decodes) run on small_step_threads"
    )
    small_step_threads: int = Field(
        default=1, ge=0, description="CPU: torch threads of a small engine step; 0: the same as threads"
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="ranks that split every layer (attention heads, MLP columns), each a "
        "process of the engine core with its share of the weights and of both KV pools (vLLM's "
        "--tensor-parallel-size); on the CPU the ranks split the cores, on CUDA one GPU each (cuda:0..N-1). "
        "Published-layout MiMo checkpoints",
    )
    enable_expert_parallel: bool = Field(
        default=False, description="MoE layers: whole routed experts per rank instead of every expert's columns "
        "(vLLM's --enable-expert-parallel; expert-parallel size = tensor_parallel_size x data_parallel_size)",
    )
    data_parallel_size: int = Field(
        default=1, ge=1, description="data-parallel attention replicas (vLLM's --data-parallel-size): only 1 is "
        "served so far (more is refused at start); scale replicas behind the gateway instead",
    )
    distributed_backend: str = Field(
        default="auto", description="the ranks' collectives: auto (NCCL on CUDA, gloo on the CPU), gloo or nccl",
    )
    speculative_config: str = Field(
        default="auto", description="speculative decoding: auto (the default: the checkpoint's MTP layers where it "
        "has them, each step's draft length chosen for goodput; off otherwise), off, or vLLM's --speculative-config "
        "JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
        "(\"draft_policy\": \"fixed\" keeps k every step); empty: off",
    )
    max_draft_tokens: int = Field(
        default=32, ge=1, description="speculative decoding: draft tokens one engine step verifies, shared by its "
        "decodes (each at least one, at most num_speculative_tokens)",
    )
    grammar_threads: int = Field(
        default=1, ge=1, description="xgrammar threads of each grammar compile worker (grammar_workers)",
    )
    grammar_workers: int = Field(
        default=2, ge=1, description="processes compiling structured-output grammars, off the engine loop, started "
        "as compiles queue (about 3 s of CPU each to import xgrammar); a hostile schema holds one until "
        "grammar_compile_timeout_s while the others serve the rest",
    )
    grammar_compile_timeout_s: float = Field(
        default=10.0, gt=0, description="CPU seconds one grammar compile may use; past it the worker is killed and "
        "the request gets a 400 naming this setting. Measured on the 2-core Xeon with a 150K-token vocabulary: the "
        "120-schema test corpus compiles in 46 ms at the median and 0.76 s at most, 128 tools x 10 parameters "
        "under tool_choice required in 1.3 s, a string of maxLength 5000 in 7.9 s; hostile schemas run for minutes",
    )
    grammar_full_speed_cpu_s: float = Field(
        default=1.0, gt=0, description="CPU seconds a grammar compile runs at full speed (the lowest priority); past "
        "them it gets grammar_slow_cpu_share of a core until grammar_compile_timeout_s. The test corpus's slowest "
        "schema takes 0.76 s",
    )
    grammar_slow_cpu_share: float = Field(
        default=0.25, gt=0, le=1, description="share of a core a grammar compile gets past grammar_full_speed_cpu_s "
        "(stopped the rest of each 100 ms): a compile burning idle cores at the lowest priority still slowed the "
        "steady streams' p99 ITL 1.3-1.5x on the 2-core EPYC VM; 1 turns the throttle off",
    )
    max_grammar_bytes: int = Field(
        default=256 * 1024, ge=1024, description="largest structured-output spec (JSON schema, regex, EBNF grammar or "
        "choices; under a forced tool_choice every tool's parameters) in UTF-8 bytes; past it a 400 naming this "
        "setting, before any compile. 128 tools x 10 parameters with descriptions are 197 KiB",
    )
    structured_any_whitespace: bool = Field(
        default=True, description="structured outputs: JSON may hold whitespace between tokens (vLLM's default); "
        "false: compact JSON (vLLM's disable_any_whitespace), which a weak model cannot pad until max_tokens; a "
        "request's structured_outputs.disable_any_whitespace overrides it",
    )
    gemv_threads: int = Field(
        default=0, ge=0, description="CPU: threads of the few-row linear kernel (decode steps' linears and routed "
        "experts); 0: threads (every core). Its elastic pool never waits for a thread that lost its core, and it "
        "runs on one thread while other processes leave no core spare",
    )
    tokenizer_word_cache: int = Field(
        default=2048, ge=0, description="words each prep thread's tokenizer copy remembers the pieces of "
        "(HF tokenizers keep 10,000 and never evict; a bounded, filled cache is flat memory); 0: no cache",
    )
    core_malloc: Literal["auto", "system"] = Field(
        default="auto", description="allocator of the engine core: auto (tcmalloc preloaded when the system has "
        "libtcmalloc_minimal, as vLLM's CPU docs recommend; else glibc), system (glibc)",
    )
    # the engine core runs in its own process, supervised by the HTTP front
    core_stall_timeout: float = Field(
        default=60.0, gt=0, description="seconds without a heartbeat from a busy engine core before it is restarted"
    )
    core_start_timeout: float = Field(default=600.0, gt=0, description="seconds a starting engine core may take")
    core_max_backoff: float = Field(default=30.0, gt=0, description="longest wait between engine-core restarts")
    # KV tiers below the device pools (README "Tiered KV")
    host_kv_full_bytes: int = Field(
        default=512 * 1024 * 1024, ge=0, description="host (L2) pool for full-layer KV; 0 turns the host tier off"
    )
    host_kv_swa_bytes: int = Field(default=64 * 1024 * 1024, ge=0, description="host (L2) pool for SWA-layer KV")
    kv_l3_url: RedisURL | None = Field(
        default=None, description="Redis URL of the L3 KV tier shared by every LLM replica (needs the host tier)"
    )
    kv_l3_page_tokens: int = Field(default=32, ge=1, description="tokens per L3 page; SWA windows at page boundaries")
    kv_l3_ttl_s: int = Field(default=86400, ge=1, description="seconds an L3 page stays in Redis")
    kv_l3_timeout: float = Field(default=0.5, gt=0, description="seconds per Redis command before L3 counts as down")
    kv_l3_prefetch_timeout: float = Field(
        default=0.5, gt=0, description="longest wait for an L3 lookup before a request is admitted without it"
    )
    swa_retention_interval: int = Field(
        default=1024, ge=0, description="K: keep SWA windows every K prompt tokens (and at the system message's end) "
        "for prompts up to swa_retention_max_len; 0 turns the every-K points off"
    )
    swa_retention_max_len: int = Field(
        default=8192, ge=0, description="prompts up to this many tokens keep SWA windows every swa_retention_interval"
    )
    # media by reference: embeddings fetched from the encoders for spans the prefix cache misses
    media_fetch_timeout: float = Field(
        default=10.0, gt=0, description="seconds to fetch one item's embeddings from its encoders by key"
    )
    media_redis_url: RedisURL | None = Field(
        default=None, description="the encoders' Redis embedding tier (their MMSERVE_ENCODER_REDIS_URL): read "
        "there first, then ask the encoders"
    )
    media_redis_prefix: str = Field(default="mmserve:enc:", description="the encoders' Redis key prefix")
    kv_events_url: RedisURL | None = Field(
        default=None, description="Redis URL to publish KV events on (router block keys the prefix tree stored and "
        "removed), which every gateway folds into one routing index; unset: none published"
    )
    kv_events_stream: str = Field(default=KV_EVENTS_STREAM, min_length=1, description="Redis stream of KV events")
    kv_events_maxlen: int = Field(
        default=100_000, ge=100, description="events the stream keeps (approximate MAXLEN); a gateway further behind "
        "reloads the replica's /kv/snapshot"
    )
    kv_events_keys: int = Field(
        default=65536, ge=1, description="router block keys a replica tracks at most (oldest dropped, as removed)"
    )
    media_fetch_allow: StrList = Field(
        default_factory=lambda: list(THIS_MACHINE), description="the encoders the LLM may fetch "
        "embeddings from (it sends its service token to them): host names (resolved: a headless Service's pods), "
        "IP addresses or networks, each optionally with :port (comma-separated or JSON list). A /v1/generate body "
        "whose media names only other sources gets a 400; default: this machine only. Empty: Redis only"
    )
    media_fetch_max_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024, description="largest embeddings response read from an encoder (streamed "
        "and cut past it: a miss); an item is cut past num_tokens x hidden x 8 bytes + 1 MiB as well"
    )

    @field_validator("media_fetch_allow", "kv_peer_allow", mode="before")
    @classmethod
    def _split_allow(cls, v):
        if isinstance(v, str):
            return json.loads(v) if v.strip().startswith("[") else [x.strip() for x in v.split(",") if x.strip()]
        return v

    @model_validator(mode="after")
    def _tiers(self):
        if self.cuda_graphs and self.attention_backend not in ("auto", "triton_paged"):
            raise ValueError(f"cuda_graphs needs attention_backend triton_paged (or auto), not "
                             f"{self.attention_backend!r}")
        if self.kv_l3_url and (self.host_kv_full_bytes <= 0 or self.host_kv_swa_bytes <= 0):
            raise ValueError("kv_l3_url needs the host KV tier: set host_kv_full_bytes and host_kv_swa_bytes > 0")
        if (self.host_kv_full_bytes > 0) != (self.host_kv_swa_bytes > 0):
            raise ValueError("host_kv_full_bytes and host_kv_swa_bytes are both 0 (no host tier) or both > 0")
        if self.distributed_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"distributed_backend must be auto, gloo or nccl, got {self.distributed_backend!r}")
        if self.kv_transport == "nixl" and self.role != "both" and not _nixl_installed():
            raise ValueError("kv_transport nixl: NIXL is not installed here (pip install nixl-cu13, or nixl on a CUDA "
                             "host); use kv_transport tcp or auto")
        if self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 (data-parallel attention) is not served yet: run one replica per "
                             "data-parallel rank behind the gateway, or use tensor_parallel_size")
        if self.tensor_parallel_size > 1:
            if self.backend != "swa":
                raise ValueError("tensor_parallel_size > 1 needs the swa backend (the hf reference runs one process)")
            if self.kv_l3_url:
                raise ValueError("kv_l3_url (the Redis KV tier) is not served with tensor_parallel_size > 1 yet: "
                                 "each rank holds its own heads' KV; use the host tier alone")
            if self.cuda_graphs:
                raise ValueError("cuda_graphs is not served with tensor_parallel_size > 1 yet; unset it")
        return self


class GatewaySettings(_ServiceSettings, _AsyncioHeapSettings):
    model_config = SettingsConfigDict(env_prefix="MMSERVE_GATEWAY_", extra="ignore")

    port: int = Field(default=8000, ge=0, le=65535, description="TCP port to listen on")
    model_name: str | None = Field(
        default=None, description="served name; unset: the name the LLM replicas report (their model directory's), "
        "and mmserve-tiny until one has answered"
    )
    encoder_urls: StrList = Field(
        default_factory=lambda: ["http://127.0.0.1:8100"], description="encoder replicas' base URLs (comma-separated "
        "or JSON list); a host name is re-resolved every dns_interval, one replica per address"
    )
    llm_urls: StrList = Field(
        default_factory=lambda: ["http://127.0.0.1:8200"], description="LLM replicas' base URLs (comma-separated or "
        "JSON list); a host name is re-resolved every dns_interval, one replica per address"
    )
    prefill_urls: StrList = Field(
        default_factory=list, description="prefill replicas (LLM replicas with role prefill; docs/disagg.md), "
        "comma-separated or JSON list: with any, llm_urls are the decode replicas and a text request whose prompt "
        "is long enough is prefilled on one of these first (conditional disaggregation); empty: every replica "
        "serves whole requests"
    )
    disagg_min_prompt_tokens: int = Field(
        default=1024, ge=0, description="with prefill_urls: a prompt estimated shorter than this is prefilled on its "
        "decode replica, unless a prefill replica is idle (disagg_idle_min_prompt_tokens); benchmarks.disagg measured "
        "1024 with the idle rule at 0: steady ITL p99 0.49x two unified replicas, output tok/s 0.99x"
    )
    disagg_idle_min_prompt_tokens: int = Field(
        default=0, ge=0, description="with prefill_urls: a prompt under disagg_min_prompt_tokens but at least "
        "this long is prefilled on a prefill replica that is idle (none of this gateway's prefills in flight): free "
        "capacity, a prefill off the decode replica's steps (benchmarks.disagg: output tok/s 0.86-0.88x two unified "
        "replicas without it, 0.99x with it); disagg_min_prompt_tokens or more: shorter prompts always stay on their decode replica"
    )
    disagg_max_prefill_queue: int = Field(
        default=0, ge=0, description="with prefill_urls: a prompt whose chosen prefill replica already has this many "
        "of this gateway's prefills in flight is prefilled on its decode replica (Dynamo's short-queue condition); "
        "0: no bound"
    )
    disagg_max_cached_fraction: float = Field(
        default=0.5, gt=0, le=1, description="with prefill_urls: a prompt whose prefix blocks the decode replica "
        "holds at least this fraction of (the router's view) is prefilled there"
    )
    api_keys: StrList = Field(
        default_factory=list, description="client keys (Authorization: Bearer KEY), comma-separated or JSON list; "
        "empty: /v1/* is open"
    )
    default_max_tokens: int = Field(default=64, ge=1, description="max_tokens of a request that sets none")
    trust_request_chat_template: bool = Field(
        default=False, description="render a chat template a request sends in chat_template_kwargs.chat_template "
        "(vLLM's --trust-request-chat-template); off: such a request gets a 400. A request's Jinja runs on this "
        "server's CPU: a nested loop holds it for minutes, so allow it only for callers you trust"
    )
    request_timeout: float = Field(default=300.0, gt=0, description="seconds one call to an encoder or LLM may take")
    max_media_items: int = Field(default=16, ge=0, description="images, audio clips and videos per request")
    max_media_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1, description="per item, counted after any Content-Encoding (gzip, "
        "deflate) is undone, as it inflates: a gzip bomb stops here"
    )
    max_request_video_pixels: int = Field(
        default=1_061_683_200, ge=1, description="decoded video pixels (sampled frames x width x height) for all "
        "videos of one request: each video's encoder gets an equal share and refuses (413) a video past it. 4 videos "
        "at the encoders' max_video_pixels (32 frames of 4K); 11 s of one core's decoding at decord's measured "
        "94 Mpx/s on the 2-core Xeon"
    )
    max_request_media_bytes: int = Field(
        default=128 * 1024 * 1024, ge=1, description="media per chat / responses request; their body limit is this "
        "base64-encoded plus 8 MiB of text (a larger body is a 413 while it streams in)"
    )
    max_text_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="largest body of /v1/completions, /tokenize, /detokenize and "
        "any other path without media (a 413 while it streams in); chat and responses take the media budget instead. "
        "8 MiB holds 1M prompt token ids (64 prompts of 16K tokens), whose JSON parse took 72 ms on the 2-core Xeon "
        "(16 MiB: 190 ms, all of it on the event loop)"
    )
    max_completion_prompts: int = Field(
        default=64, ge=1, description="prompts x n of one /v1/completions request (each goes upstream as its own "
        "generation under one admission slot); past it a 400: split larger batches. Measured on the 2-core Xeon "
        "against a fake LLM: a batch of 64 kept the gateway's /healthz near its quiet latency, 128 added 0.2 s, "
        "256 0.6 s, 1,024 3.4 s (20,000 held the gateway for minutes)"
    )
    max_tools: int = Field(default=128, ge=0, description="tools per request (OpenAI's documented limit); past it "
                           "a 400")
    max_schema_bytes: int = Field(
        default=64 * 1024, ge=256, description="bytes of one tool's parameters schema and of the response_format / "
        "structured_outputs grammar, as the JSON / grammar text sent upstream; past it a 400. Every schema is "
        "compiled into a grammar: 64 KiB of required properties compiled in 0.47 s (xgrammar, one thread, a 50K-token "
        "vocabulary, the 2-core Xeon); tool schemas are a few KiB. Shape, not size, makes the slow ones (16 KiB of "
        "optional properties: 31 s), which the grammar compile time limit bounds"
    )
    fetch_timeout: float = Field(default=20.0, gt=0, description="seconds to fetch one media URL")
    max_redirects: int = Field(
        default=3, ge=0, description="redirects followed when fetching a media URL, each hop checked by the SSRF guard"
    )
    allowed_hosts: StrList = Field(
        default_factory=list, description="hosts/CIDRs exempt from the SSRF private-address guard"
    )
    # routing (appended by the gateway)
    llm_routing: Literal["cache_aware", "round_robin"] = Field(
        default="cache_aware", description="how a generation picks its LLM replica: cache_aware (the one whose prefix "
        "cache holds the longest prefix of its prompt, unless it is overloaded against the least-loaded one) or "
        "round_robin"
    )
    router_index_blocks: int = Field(
        default=65536, ge=1, description="prefix blocks (64 chars each) the cache-aware router remembers per LLM "
        "replica; about 15 MB per replica when full"
    )
    kv_events_url: RedisURL | None = Field(
        default=None, description="Redis URL of the LLM replicas' KV events: route on what they report they hold "
        "(one view for every gateway); unset or unreachable: each gateway's own record of what it sent"
    )
    kv_events_stream: str = Field(default=KV_EVENTS_STREAM, min_length=1, description="Redis stream of KV events")
    router_recent_s: float = Field(
        default=5.0, ge=0, description="with KV events: a replica also counts as holding what this gateway sent it "
        "in the last this many seconds (its events may not be in yet); 0: events alone"
    )
    health_interval: float = Field(
        default=5.0, ge=0, description="seconds between /readyz probes of replicas; 0 disables"
    )
    health_fail_threshold: int = Field(
        default=3, ge=1, description="consecutive failed /readyz probes before a replica leaves rotation"
    )
    dns_interval: float = Field(
        default=30.0, ge=0, description="seconds between DNS re-resolutions of replica hosts; 0 disables"
    )
    upstream_attempts: int = Field(default=3, ge=1, description="distinct replicas tried per call")
    media_by_ref: bool = Field(
        default=True, description="send media to the LLM by key (it fetches what its prefix cache misses); "
        "false: every request carries the embeddings"
    )
    encoder_load_factor: float = Field(
        default=1.5, ge=1.0, description="an encoder above this times the mean load hands items on along the ring"
    )
    # admission control: past max_in_flight + max_queue a generation (chat, completions, responses) is a 429
    # with Retry-After; the slot is taken before its body is read
    max_in_flight: int = Field(default=256, ge=1, description="chat, completions and responses requests served at once")
    max_queue: int = Field(default=512, ge=0, description="chat, completions and responses requests waiting for a slot")
    queue_timeout: float = Field(default=30.0, gt=0, description="longest wait for a slot before a 429")
    connect_timeout: float = Field(default=5.0, gt=0, description="seconds to connect to an encoder or LLM")
    upstream_keepalive_expiry: float = Field(
        default=UPSTREAM_KEEPALIVE_EXPIRY_S, gt=0, description="seconds a pooled connection to an encoder or LLM may "
        "sit idle before the gateway drops it; keep it below their keep_alive_timeout (30 s by default)"
    )

    @field_validator("encoder_urls", "llm_urls", "prefill_urls", "api_keys", "allowed_hosts", mode="before")
    @classmethod
    def _csv(cls, v):
        if isinstance(v, str):
            if v.strip().startswith("["):
                return json.loads(v)
            return [s.strip() for s in v.split(",") if s.strip()]
        return v
