"""One non-zero rank of the engine core's tensor-/expert-parallel group (``llm_svc.core.ranks``):
joins the group, loads its share of the model, builds its runner (and host tier) as rank 0 says
(``driver.RankSetup``), then repeats rank 0's calls (``driver.serve_rank``) until told to stop.

Started by rank 0 as ``python -m llm_svc.core.rank_worker --rank R --world N --port P --parent
PID --cpus LIST`` with the service's settings in ``MMSERVE_LLM_CORE_SETTINGS``; it dies with rank 0."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.settings import LLMSettings

log = logging.getLogger("llm_svc.core.rank")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--cpus", default="")
    args = ap.parse_args(argv)
    from .process import SETTINGS_ENV, _die_with_parent, core_threads, step_threads
    from .ranks import pin, rank_device

    _die_with_parent(args.parent)
    pin([int(c) for c in args.cpus.split(",") if c])
    settings = LLMSettings.model_validate_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    import time

    import torch

    from llm_svc.parallel import ParallelConfig
    from llm_svc.parallel.comm import init_group

    from ..attention import cpu_paged
    from ..engine.model_runner import ModelRunner
    from ..loading.loader import load_lm
    from ..models import build_model, cpu_gemv
    from ..offload.host_kv import HostKV
    from .driver import serve_rank

    threads = core_threads(settings)
    torch.set_num_threads(threads)
    cpu_gemv.set_threads(settings.gemv_threads or threads)
    cpu_paged.set_threads(threads)
    par = ParallelConfig.of(settings)
    device = rank_device(settings.device, args.rank)
    group = init_group(args.rank, args.world, args.port, par.backend_for(device), device, shm=par.shared_memory)
    t0 = time.perf_counter()
    lm = load_lm(settings.model_dir, device, settings.dtype, parallel=par, group=group)
    log.info("rank %d loaded its share in %.2f s", args.rank, time.perf_counter() - t0)
    model = build_model(lm.arch, lm.model, linear=settings.linear_backend)
    setup = group.broadcast(None)
    runner = ModelRunner(model, setup.num_full_slots, setup.num_swa_slots, device=device,
                         kv_dtype=getattr(torch, setup.kv_dtype), attention=setup.attention,
                         threads=step_threads(settings))
    runner.logits = False  # rank 0 samples
    host = None
    if setup.host_full_slots:
        host = HostKV(runner.kv, [s.kind for s in model.layers], setup.host_full_slots, setup.host_swa_slots)
    from shared.gc_tuning import freeze_startup_heap

    freeze_startup_heap(f"rank {args.rank} {os.getpid()}")
    serve_rank(runner, host, group)
    log.info("rank %d stopping", args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
