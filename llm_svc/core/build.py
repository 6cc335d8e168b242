"""``build_engine``: model + KV pools sized from the byte budget + scheduler + runner -> Engine."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shared.settings import LLMSettings

from ..attention import FULL, SLIDING
from ..engine.engine import Engine
from ..engine.model_runner import ModelRunner
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..kv.budget import size_pools
from ..loader import DTYPES, LoadedLM
from ..models import build_model


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
    def of(cls, model, dtype: torch.dtype) -> "MeasuredGeometry":
        size = torch.finfo(dtype).bits // 8
        per = {FULL: 0, SLIDING: 0}
        for spec in model.layers:
            per[spec.kind] += spec.kv_heads * (spec.qk_dim + spec.v_dim) * size
        return cls(per[FULL], per[SLIDING], model.window)


def kv_dtype_of(settings: LLMSettings, lm: LoadedLM) -> torch.dtype:
    """The KV pools' dtype: ``kv_dtype`` ("auto": the model's dtype)."""
    return lm.dtype if settings.kv_dtype == "auto" else DTYPES[settings.kv_dtype]


def build_engine(settings: LLMSettings, lm: LoadedLM, scheduler_overrides: dict | None = None) -> Engine:
    """Model + pools sized from the byte budget + scheduler + runner, wired into an Engine."""
    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(
        max_batch_tokens=settings.max_batch_tokens,
        max_running=settings.max_running,
        window=model.window,
        enable_prefix_cache=settings.enable_prefix_cache,
        **{"policy": settings.schedule_policy, **(scheduler_overrides or {})},
    )
    kv_dtype = kv_dtype_of(settings, lm)
    geometry = MeasuredGeometry.of(model, kv_dtype)
    num_full, num_swa = size_pools(kv_budget_bytes(settings, lm.device), geometry, settings.swa_fraction,
                                   max_chunk=settings.max_batch_tokens, expected_seq_len=settings.max_model_len,
                                   release_interval=cfg.decode_release_interval)
    num_swa = max(num_swa, cfg.min_swa_slots())
    scheduler = Scheduler(cfg, num_full, num_swa)
    runner = ModelRunner(model, num_full, num_swa, device=lm.device, kv_dtype=kv_dtype)
    return Engine(runner, scheduler, lm.eos_token_ids)
