"""The README benchmark table's rows: each benchmark's command and what it compares (its
baseline named). ``benchmarks.table`` fills in each row's kind and result from the results files."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    benchmark: str
    command: str  # markdown, as the cell shows it
    compares: str  # what it compares, the baseline named
    kind_note: str = ""  # after the kind, e.g. "in-process"


ROWS = (
    Row('kv_capacity', '`python -m benchmarks.kv_capacity`', '32K-token requests admitted in one byte budget, geometry from a published-format MiMo-V2.5-Pro `config.json` (10 full + 60 SWA layers, W=128, 8 KV heads, 192/128): dual pools vs one full pool'),
    Row('prefix_reuse', '`python -m benchmarks.prefix_reuse`', 'multi-session agent trace, working set > budget: our window-safe SWA tree (no checkpoints) vs **vLLM-v1-like hybrid manager** (one LRU, eager SWA free, tail first) and keep-SWA-for-every-token'),
    Row('sched_ttft', '`python -m benchmarks.sched_ttft`', 'near-saturation agentic trace through the real scheduler: compute-aware vs FCFS'),
    Row('step_scaling', '`python -m benchmarks.step_scaling`', 'decode ms/step, tiny MiMo, 16 and 64 sequences at context 256/2K/8K/32K: persistent slot tables vs the per-step slot lists of `d5857b8`'),
    Row('vs_vllm', '`python -m benchmarks.vs_vllm [--model mimo\\|gemma3\\|both] [--trace chat\\|long\\|agent\\|all] [--sweep]`', 'vLLM 0.32 CPU (its defaults: 1 bound OpenMP thread, tcmalloc + iomp preloaded, torch.compile, prefix caching) vs gateway + our LLM service (its defaults), same checkpoint / client / seeded traces, A-B-B-A, thread bindings and KV recorded'),
    Row('structured_output', '`python -m benchmarks.structured_output [--quick]`', "16 streams json_schema vs unconstrained, ours vs vLLM 0.32; p99 gaps of plain streams while a 9th request's 200-property schema compiles vs the same request unconstrained"),
    Row('n_sampling', '`python -m benchmarks.n_sampling [--quick]`', 'n = 4 vs 4 separate requests, ours vs vLLM 0.32: prompt tokens computed, wall time'),
    Row('grammar_engines', '`python -m benchmarks.grammar_engines [--quick]`', 'xgrammar vs llguidance: cold compile over the schema corpus, mask fill per token along one path', kind_note='in-process'),
    Row('matmul_efficiency', '`python -m benchmarks.matmul_efficiency`', "the engine's matmul GFLOP/s (from the profiled ops' shapes and own time) over this machine's fp32 GEMM peak measured in the run, same threads; prefill-heavy and decode-heavy"),
    Row('aiperf_chat', '`python -m benchmarks.aiperf_chat`', 'NVIDIA aiperf 0.13 (real load client) against the quickstart stack: streamed chat, one 256x256 PNG each, 20% cancelled, 32 tokens out (`ignore_eos`)'),
    Row('front_isolation', '`python -m benchmarks.front_isolation`', 'p99 of small requests and `/readyz` while 8 MB prompts arrive every 2 s vs without'),
    Row('engine_throughput', '`python -m benchmarks.engine_throughput`', '32 concurrent requests, tiny model: our engine vs transformers `generate`'),
    Row('encoder_batching', '`python -m benchmarks.encoder_batching [--tower so400m\\|mimo-omni]`', "images/s at concurrency 16: cross-request batching vs batch size 1 (cache off); small 24-layer tower, SigLIP-so400m's geometry (random weights, 112 px), and the MiMo-V2.5 ViT (16 blocks of width 128 in an omni checkpoint, 96 px = 9 tokens)"),
    Row('omni_audio_tower', '`python -m benchmarks.omni_audio_tower --seconds 10 60 --repeat 2`', "one forward of the MiMo-V2.5 omni audio tower at the published geometry (900 M params, random weights, float32, 2 shared cores at load ~3-4): seconds of audio per second of compute; the RVQ tokenizer's share"),
    Row('embedding_cache', '`python -m benchmarks.embedding_cache`', 'repeated vs cold image; Zipf workload'),
    Row('media_ref', '`python -m benchmarks.media_ref`', 'multi-turn image chats through gateway + encoder + `swa` LLM: media by reference vs by value (every request carries the embeddings); tiny model, images of [16, 64] float32', kind_note='bytes and counts exact'),
    Row('video_decode', '`python -m benchmarks.video_decode`', '5 min 720p H.264, 64 frames: chunked parallel (W = 1, 2 workers) vs the **best single reader** (decord / torchcodec with library-default threading; one-thread readers also shown)'),
    Row('e2e_load', '`python -m benchmarks.e2e_load [--llms 4]`', 'whole stack, multimodal multi-turn: cache-aware vs round-robin LLM routing, fresh stacks, sides alternated over 3 repeats'),
    Row('overload', '`python -m benchmarks.overload [--quick]`', "1x/2x/4x offered load, admission control vs the same stack unbounded, each side on a stack of its own (neither side's backlog or prefix tree weighs on the other), runs mirrored in time (a drift weighs on every level alike; `--quick`, about 1.5 min: one forward pass of 4 s runs, clients give up after 10 s): goodput, 429 share, p99 of admitted, 5xx, CPU per process and of the other side's stack, RSS after every run; capacity measured at saturation (closed loops of 4, 8, 16, ... clients); lean keep-alive load generator"),
    Row('soak', '`python -m benchmarks.soak [--quick]`', 'mixed traffic for 3 / 30 min, RSS of every service over time, growth after warm-up per 30 min'),
    Row('tiered_kv', '`python -m benchmarks.tiered_kv`', "(1) agent trace, 20 sessions x 14 turns sharing a 3K-token system prompt, working set 5.5x the device pool: device only (what vLLM/SGLang keep without offload) vs + host vs + host + Redis; (2) a returning session's 4K-token prefix (Gemma 3, 6 layers) recomputed vs restored from host / Redis; (3) bytes per restore vs a transfer that is not SWA-masked"),
    Row('gpu_check', '`python -m benchmarks.gpu_check [--device cuda]`', 'the one script for a lent GPU: logits vs transformers, tok/s at 1/16/64 sequences, step time vs the HBM bound'),
)
