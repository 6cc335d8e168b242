"""``build_engine``: model + KV pools sized from the byte budget + scheduler + runner -> Engine."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.settings import LLMSettings

from ..attention import FULL, SLIDING
from ..engine.engine import Engine
from ..engine.grammar import GrammarCache
from ..engine.model_runner import ModelRunner
from ..engine.step_threads import StepThreads
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine.mtp_runner import MTPRunner
from ..engine.speculate import Speculator
from ..kv.budget import size_pools
from llm_svc.loading.loader import DTYPES, LoadedLM
from ..models import build_model
from ..models.linear import AMX_MIN_ROWS, amx_bf16, warm_buckets
from ..parallel import SINGLE, RankGroup
from ..engine.spec import SpeculativeConfig

log = logging.getLogger(__name__)


def kv_budget_bytes(settings: LLMSettings, device: torch.device) -> int:
    """``kv_bytes``, or ``kv_fraction`` of the device's free memory when that is set."""
    if settings.kv_fraction <= 0:
        return settings.kv_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * settings.kv_fraction)


@dataclass(frozen=True)
class MeasuredGeometry:
    """Bytes per slot of each pool, measured from the model's real layer shapes (MiMo's sliding
    layers have twice the KV heads of its full layers, which a single ``kv_heads`` cannot say).
    Has what ``size_pools`` reads from a ``KVGeometry``."""

    full_token_bytes: int
    swa_token_bytes: int
    window: int

    @classmethod
    def of(cls, model, dtype: torch.dtype, extra_sliding: int = 0) -> "MeasuredGeometry":
        """``extra_sliding``: bytes per SWA slot of other sliding layers on the same slots (MTP)."""
        size = torch.finfo(dtype).bits // 8
        per = {FULL: 0, SLIDING: 0}
        for spec in model.layers:
            per[spec.kind] += spec.kv_heads * (spec.qk_dim + spec.v_dim) * size
        return cls(per[FULL], per[SLIDING] + extra_sliding, model.window)


def mtp_kv_token_bytes(layer, dtype: torch.dtype) -> int:
    """KV bytes per position of one MTP layer (``mimo_mtp.MTPLayer``)."""
    a = layer.self_attn
    return (a.k_proj.out_features + a.v_proj.out_features) * (torch.finfo(dtype).bits // 8)


def kv_dtype_of(settings: LLMSettings, lm: LoadedLM) -> torch.dtype:
    """The KV pools' dtype: ``kv_dtype`` ("auto": the model's dtype)."""
    return lm.dtype if settings.kv_dtype == "auto" else DTYPES[settings.kv_dtype]


# a CPU step's GEMMs are near their peak rate from ~256 rows. Re-measured for TTFT under load
# (vs_vllm MiMo checkpoint in-process, float32, 16 chats in flight, 48 requests of 128-2,048
# prompt / 64-256 output tokens, 2-core Xeon): a step costs ~15 ms + 0.22 ms per prompt token +
# 0.8 ms per decode (least squares over ~520 steps); a new request's queue wait is ~0 (p50 <= 5
# ms) and its TTFT is its own prefill step (p50 ~0.30 s of 0.40 s); 0 / 256 / 1024 here gave TTFT
# p50 0.405-0.409 / 0.401-0.411 / 0.404 s and 259-275 / 270-275 / 272 tok/s: the same within
# the noise, so the budget is not where a prompt waits (max_batch_tokens 1024: 0.431 s, 257).
# Through the service (``python -m benchmarks.vs_vllm --requests 32 --pairs 1``, one run each)
# 256 kept its edge over 0: chat concurrency TTFT p50 579 vs 725 ms at 308 vs 302 tok/s, rate
# 249 vs 288 ms (vLLM 1,340 / 999 and 456 / 445 ms in the same runs).
CPU_PREFILL_STEP_TOKENS = 256


def prefill_step_tokens(settings: LLMSettings) -> int:
    """``settings.prefill_step_tokens``, or by device: on the CPU a step's time grows with its
    tokens, so prompts that arrive together are better prefilled one after another (each gets
    its first token a step sooner); a GPU step costs about the same up to thousands of tokens."""
    if settings.prefill_step_tokens is not None:
        return settings.prefill_step_tokens
    return 0 if settings.device.startswith("cuda") else CPU_PREFILL_STEP_TOKENS


def build_engine(settings: LLMSettings, lm: LoadedLM, scheduler_overrides: dict | None = None,
                 threads: StepThreads | None = None, group: RankGroup = SINGLE) -> Engine:
    """Model + pools sized from the byte budget + scheduler + runner, wired into an Engine
    (``threads``: torch threads per step by its size; None leaves torch's setting alone).

    ``group`` (rank 0 of a tensor-parallel group, the other ranks started and loaded): the pools
    are sized from this rank's share of the heads, every rank is told the sizes
    (``driver.RankSetup``), and the runner and host tier drive the other ranks
    (``driver.DrivingRunner`` / ``DrivenHost``)."""
    model = build_model(lm.arch, lm.model, linear=settings.linear_backend)
    cfg = SchedulerConfig(
        max_batch_tokens=settings.max_batch_tokens,
        max_running=settings.max_running,
        window=model.window,
        enable_prefix_cache=settings.enable_prefix_cache,
        l3_page_tokens=settings.kv_l3_page_tokens if settings.kv_l3_url else 0,
        max_draft_tokens=settings.max_draft_tokens,
        prefill_step_tokens=prefill_step_tokens(settings),
        **{"policy": settings.schedule_policy, **(scheduler_overrides or {})},
    )
    kv_dtype = kv_dtype_of(settings, lm)
    spec = SpeculativeConfig.resolve(settings.speculative_config, len(getattr(lm.model, "mtp", None) or []))
    mtp_layers = []
    if spec is not None and spec.method == "mtp":
        mtp_layers = list(getattr(lm.model, "mtp", None) or [])
        spec = spec.with_mtp_layers(len(mtp_layers))
        mtp_layers = mtp_layers[:spec.num_speculative_tokens]
    # the MTP layers' KV sits on the SWA pool's slots: counted in each slot's bytes
    geometry = MeasuredGeometry.of(model, kv_dtype, sum(mtp_kv_token_bytes(m, kv_dtype) for m in mtp_layers))
    num_full, num_swa = size_pools(kv_budget_bytes(settings, lm.device), geometry, settings.swa_fraction,
                                   max_chunk=settings.max_batch_tokens,
                                   expected_seq_len=settings.max_model_len or lm.context_len,
                                   release_interval=cfg.decode_release_interval)
    num_swa = max(num_swa, cfg.min_swa_slots())
    host_full = settings.host_kv_full_bytes // geometry.full_token_bytes
    host_swa = settings.host_kv_swa_bytes // geometry.swa_token_bytes if host_full else 0
    scheduler = Scheduler(cfg, num_full, num_swa, num_host_full=host_full, num_host_swa=host_swa)
    graphs = settings.cuda_graphs and lm.device.type == "cuda"
    if settings.cuda_graphs and not graphs:
        log.warning("cuda_graphs is for CUDA devices: the %s engine runs its decodes eagerly", lm.device.type)
    attention = "triton_paged" if graphs and settings.attention_backend == "auto" else settings.attention_backend
    runner = ModelRunner(model, num_full, num_swa, device=lm.device, kv_dtype=kv_dtype, attention=attention,
                         threads=threads, decode_graphs=settings.cuda_graph_max_batch if graphs else 0,
                         max_positions=settings.max_model_len or lm.context_len,
                         table_rows=2 * settings.max_running)
    if runner.graphs is not None:
        try:
            runner.graphs.capture_all()
        except Exception as e:  # a model op that cannot be recorded: serve eagerly rather than not at all
            log.warning("CUDA graphs off, decodes run eagerly: recording them failed: %s", e)
            runner.graphs, runner.graphs_error = None, f"{type(e).__name__}: {e}"
    if group.world > 1:
        from .driver import DrivingRunner, RankSetup

        tiered = bool(host_full and host_swa)
        group.broadcast(RankSetup(num_full, num_swa, str(kv_dtype).removeprefix("torch."), attention,
                                  host_full if tiered else 0, host_swa if tiered else 0))
        runner = DrivingRunner(runner, group)
    tiers = build_tiers(settings, lm, model, runner, scheduler, kv_dtype, group) if host_full and host_swa else None
    # the front tries each source within media_fetch_timeout; this is the core's backstop
    grammars = GrammarCache(lm.tokenizer, lm.vocab_size, lm.eos_token_ids, threads=settings.grammar_threads,
                            any_whitespace=settings.structured_any_whitespace, workers=settings.grammar_workers,
                            max_bytes=settings.max_grammar_bytes, timeout_s=settings.grammar_compile_timeout_s,
                            full_speed_s=settings.grammar_full_speed_cpu_s,
                            slow_share=settings.grammar_slow_cpu_share)
    speculator = None
    if spec is not None:
        mtp = MTPRunner(runner, mtp_layers, lm.model.get_input_embeddings(), lm.model.get_output_embeddings(),
                        model.window, linear=settings.linear_backend) if mtp_layers else None
        speculator = Speculator(spec, lm.eos_token_ids, mtp, max_draft_tokens=settings.max_draft_tokens)
    if settings.warmup and lm.device.type == "cpu":
        warm_buckets(settings.max_batch_tokens, threads)  # the MTP runner's linears included
    if lm.device.type == "cpu":
        log_kernel_paths(lm.dtype, kv_dtype)
        if lm.dtype == torch.bfloat16 and settings.linear_backend == "auto" and amx_bf16():
            log.info("linears and experts: bfloat16 calls of %d rows or more on oneDNN's AMX GEMM, fewer on the "
                     "packed kernel (linear_backend=packed: the packed kernel only)", AMX_MIN_ROWS)
    return Engine(runner, scheduler, lm.eos_token_ids, tiers=tiers, media_timeout=2 * settings.media_fetch_timeout + 1,
                  grammars=grammars, speculator=speculator)


def log_kernel_paths(dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, str | None]:
    """Which build each family of non-linear C kernels runs at the model's ``dtype`` (one log line
    each, once per process): ``float32``, ``bfloat16/avx512_bf16`` or ``bfloat16/portable`` (a CPU
    without the AVX-512 BF16 conversions), or not built (the torch fallback). float16 activations
    have no build: their kernels' ``supports`` send them to torch."""
    from ..attention import cpu_paged, cpu_prefill
    from ..kernels.ckernels import log_act_paths
    from ..models import cpu_fused

    return log_act_paths({"norm / rope (cpu_fused)": cpu_fused.KERNELS.get(dtype),
                          "paged decode + KV write (cpu_paged)": cpu_paged.ACT_KERNELS.get((dtype, kv_dtype)),
                          "paged prefill (cpu_prefill)": cpu_prefill.ACT_KERNELS.get((dtype, kv_dtype))})


def model_identity(model_dir: str | Path) -> str:
    """What distinguishes one checkpoint's KV from another's with the same config: the config and
    each weight file's name, size and first MiB (its header and leading tensors)."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for f in sorted(d.rglob("*")):
        if f.is_file() and (f.name.endswith("config.json") or f.suffix in (".safetensors", ".bin", ".pt")):
            h.update(f.relative_to(d).as_posix().encode())
            h.update(str(f.stat().st_size).encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def build_tiers(settings: LLMSettings, lm: LoadedLM, model, runner: ModelRunner, scheduler: Scheduler,
                kv_dtype: torch.dtype, group: RankGroup = SINGLE):
    """Host pools beside the runner's, and the shared Redis tier when ``kv_l3_url`` is set (one
    rank only); under tensor parallelism every rank copies its own heads' share."""
    from ..offload.host_kv import HostKV
    from ..offload.l3 import L3Store, fingerprint
    from shared.peer_auth import resolve as resolve_peer_key
    from ..offload.tiers import KVTiers

    kinds = [spec.kind for spec in model.layers]
    kv = scheduler.kv
    host = HostKV(runner.kv, kinds, kv.host_full_pool.num_slots, kv.host_swa_pool.num_slots)
    if group.world > 1:
        from .driver import DrivenHost

        host = DrivenHost(host, group)
    l3 = None
    if settings.kv_l3_url:
        fp = fingerprint({
            "model": model_identity(settings.model_dir), "arch": lm.arch,
            "layers": [(s.kind, s.kv_heads, s.qk_dim, s.v_dim) for s in model.layers],
            "kv_dtype": str(kv_dtype), "page": settings.kv_l3_page_tokens, "window": model.window,
        })
        l3 = L3Store(settings.kv_l3_url, fp, settings.kv_l3_page_tokens, model.window,
                     host.token_bytes(FULL), host.token_bytes(SLIDING), ttl_s=settings.kv_l3_ttl_s,
                     timeout_s=settings.kv_l3_timeout,
                     peer=resolve_peer_key(settings.peer_key, [settings.kv_l3_url], "MMSERVE_LLM_PEER_KEY"))
    return KVTiers(kv, host, l3, prefetch_timeout=settings.kv_l3_prefetch_timeout)
