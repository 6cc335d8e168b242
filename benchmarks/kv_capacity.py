"""KV capacity: how many 32K-token requests one KV byte budget holds, dual pools vs one pool.

Geometry: read from a published-format MiMo-V2.5-Pro ``config.json``
(``benchmarks/configs/mimo-v2.5-pro.config.json``, parsed by the loader's ``mimo_geometry``):
70 layers = 10 full-attention + 60 sliding (W=128), 8 KV heads on both kinds, K dim 192 / V dim
128, bf16. The ratio is reported in requests and in KV bytes per request.

* ours: a full pool (10 layers, every token) + a SWA pool (60 layers), split by
  ``size_pools``' default rule; out-of-window SWA is released after every prefill chunk and
  every N decode tokens.
* baseline: one full-length pool, every layer keeps KV for every token (``release_swa=False``,
  both pools of equal size, so each slot is 70 layers).

The byte budget is a whole number of baseline requests (16 with --quick, 32 without).

1. Admission (the count reported): 32768-token requests (32768 - N prompt tokens + N decode
   tokens) are admitted one after another through the real allocator (``KVManager``) exactly as
   the scheduler does it: full slots for the whole context, SWA slots chunk by chunk with the
   window release after each chunk, then N decode tokens (the most a request holds between two
   releases: W + N). Admission stops at the first request that does not fit.
2. Continuous batching (a check of the same budget through the scheduler): a stream of
   32768-token prompts that keep decoding runs through ``Scheduler`` + ``SimRunner`` (no model)
   until a step that starts with every resident request decoding admits nobody; printed with the
   mean resident length (ours fills more slowly, so its requests have decoded a little more).
   Its budget has room for 64 more tokens per baseline request, for the same reason.

Geometric limit at 32K (equal per-layer bytes on both kinds): 70 * 32768 / (10 * 32768 + 60 * 128) = 6.84x.

    python -m benchmarks.kv_capacity [--quick] [--requests-in-baseline N] [--skip-scheduler] [--config FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks import _results
from llm_svc.types.request import Request
from mmserve.testing.sched_sim import SimRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.kv.budget import KVGeometry, size_pools
from llm_svc.kv.manager import KVManager
from shared.schemas import SamplingParams

CONFIG = Path(__file__).parent / "configs" / "mimo-v2.5-pro.config.json"


def geometry_from_config(path: Path = CONFIG, dtype_bytes: int = 2) -> KVGeometry:
    """KV geometry of a MiMo ``config.json`` (either dialect), through the loader's parser."""
    from llm_svc.models.geometry import FULL_T, mimo_geometry

    g = mimo_geometry(json.loads(Path(path).read_text()), path)
    if (g.sliding.qk_dim, g.sliding.v_dim) != (g.full.qk_dim, g.full.v_dim):
        raise ValueError(f"{path}: KVGeometry needs one qk/v head dim for both layer kinds")
    n_full = sum(t == FULL_T for t in g.layer_types)
    return KVGeometry(full_layers=n_full, swa_layers=g.num_layers - n_full, window=g.window, kv_heads=g.full.kv_heads,
                      qk_head_dim=g.full.qk_dim, v_head_dim=g.full.v_dim, dtype_bytes=dtype_bytes,
                      swa_kv_heads=g.sliding.kv_heads)
SEQ_LEN = 32768
CHUNK = 2048
RELEASE_N = 16


def admit_until_full(num_full: int, num_swa: int, window: int, release: bool) -> dict:
    """Admit 32K-token requests through the allocator until one does not fit."""
    kv = KVManager(num_full, num_swa, window, enable_prefix_cache=False)
    prompt = SEQ_LEN - RELEASE_N
    held = []
    while True:
        seq = kv.start([])
        ok = kv.reserve(seq, SEQ_LEN, 0, 0)  # full slots for the whole context
        for s in range(0, prompt, CHUNK):
            e = min(prompt, s + CHUNK)
            ok = ok and kv.reserve(seq, SEQ_LEN, s, e)
            if ok and release:
                kv.release_window(seq, e - window)
        ok = ok and kv.reserve(seq, SEQ_LEN, prompt, SEQ_LEN)  # N decode tokens before a release
        if not ok:
            kv.finish(seq, [], seq.cached_len, cache=False)
            break
        held.append(seq)
    kv.check_integrity(held)
    n = len(held)
    swa_used = kv.swa_pool.num_used
    return {
        "requests": n,
        "full_used": kv.full_pool.num_used,
        "swa_used": swa_used,
        "swa_per_request": round(swa_used / max(n, 1), 1),
        "limited_by": "full" if kv.full_pool.num_free < SEQ_LEN else "swa",
    }


def run_scheduler(cfg: SchedulerConfig, num_full: int, num_swa: int, n_requests: int, seed: int) -> dict:
    """Requests resident at once in the scheduler's steady state."""
    sched = Scheduler(cfg, num_full, num_swa)
    runner = SimRunner(lambda rid: sched.requests[rid], cfg.window, verify=False, next_token=lambda r, sf: 3)
    rng = random.Random(seed)
    for i in range(n_requests):
        # distinct from the first token on (no sharing); small ids keep Python ints shared
        ids = [1000 + i] + [rng.randrange(1, 200) for _ in range(SEQ_LEN - 1)]
        sched.add(Request(f"r{i}", ids, SamplingParams(max_tokens=4096, ignore_eos=True)))
    t0 = time.perf_counter()
    resident = None
    while resident is None:
        before = {r.req_id for r in sched.running}
        decoding_at_start = bool(before) and all(r.num_computed >= len(r.prompt_ids) for r in sched.running)
        batch = sched.schedule()
        if batch is None:
            break
        sched.postprocess(batch, runner.run(batch))
        admitted = any(s.req_id not in before for s in batch.seqs)
        if sched.waiting and not admitted and decoding_at_start:
            resident = len(sched.running)
    assert resident is not None, "the stream never filled the pools: submit more requests"
    sched.check_integrity()
    return {
        "requests": resident,
        "mean_len": round(sum(r.num_tokens for r in sched.running) / resident, 1),
        "preemptions": sched.num_preemptions,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a budget of 16 baseline requests")
    ap.add_argument("--requests-in-baseline", type=int, default=None, help="budget in baseline requests")
    ap.add_argument("--skip-scheduler", action="store_true", help="admission count only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", type=Path, default=CONFIG, help="a MiMo config.json (published or transformers form)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    k_base = args.requests_in_baseline or (2 if args.smoke else 16 if args.quick else 32)
    g = geometry_from_config(args.config)
    slot70 = g.full_token_bytes + g.swa_token_bytes
    kv_bytes = k_base * SEQ_LEN * slot70
    geometric = slot70 * SEQ_LEN / (g.full_token_bytes * SEQ_LEN + g.swa_token_bytes * g.window)
    nf, ns = size_pools(kv_bytes, g, max_chunk=CHUNK, expected_seq_len=SEQ_LEN, release_interval=RELEASE_N)
    n_single = kv_bytes // slot70

    print(f"geometry ({args.config.name}): {g.full_layers} full + {g.swa_layers} sliding layers, W={g.window}, "
          f"full {g.full_token_bytes} B / sliding {g.swa_token_bytes} B per token (all layers of the kind); "
          f"KV budget {kv_bytes / 2**30:.1f} GiB")
    print(f"ours: full pool {nf} slots x {g.full_layers} layers + SWA pool {ns} slots x {g.swa_layers} layers;"
          f" baseline: {n_single} slots x {g.full_layers + g.swa_layers} layers")
    t0 = time.perf_counter()
    base = admit_until_full(n_single, n_single, g.window, release=False)
    ours = admit_until_full(nf, ns, g.window, release=True)
    ratio = ours["requests"] / base["requests"]
    # KV bytes one admitted request holds, each side (full slots x full bytes + SWA slots x SWA bytes)
    for r in (base, ours):
        r["bytes_per_request"] = round((r["full_used"] * g.full_token_bytes + r["swa_used"] * g.swa_token_bytes)
                                       / max(r["requests"], 1))
    bytes_ratio = base["bytes_per_request"] / ours["bytes_per_request"]
    print(f"[admission, {time.perf_counter() - t0:.1f} s] 32K-token requests admitted: "
          f"baseline {base['requests']}, ours {ours['requests']} "
          f"({ours['swa_per_request']} SWA slots each, limited by the {ours['limited_by']} pool)")
    print(f"ratio: {ratio:.2f}x requests, {bytes_ratio:.2f}x KV bytes per request "
          f"({base['bytes_per_request'] / 2**20:.1f} MiB vs {ours['bytes_per_request'] / 2**20:.1f} MiB)   "
          f"(geometric limit {geometric:.2f}x, Xiaomi ~7x, target >= 6.7x)")

    sched_res = None
    if not args.skip_scheduler:
        cfg = SchedulerConfig(
            max_batch_tokens=64 * CHUNK, max_chunk_tokens=CHUNK, max_running=100_000, window=g.window,
            decode_release_interval=RELEASE_N, enable_prefix_cache=False,
        )
        # room for the tokens decoded while the pools fill (and the admission reserve of one
        # slot per running request), so the baseline's count is not rounded down either
        sched_bytes = k_base * (SEQ_LEN + 64) * slot70
        n1 = sched_bytes // slot70
        nf2, ns2 = size_pools(sched_bytes, g, max_chunk=CHUNK, expected_seq_len=SEQ_LEN, release_interval=RELEASE_N)
        sb = run_scheduler(SchedulerConfig(**{**cfg.__dict__, "release_swa": False}), n1, n1, k_base + 4, args.seed)
        so = run_scheduler(cfg, nf2, ns2, ours["requests"] + 8, args.seed)
        tok_ratio = so["requests"] * so["mean_len"] / (sb["requests"] * sb["mean_len"])
        sched_res = {"baseline": sb, "ours": so, "ratio": round(so["requests"] / sb["requests"], 3),
                     "resident_tokens_ratio": round(tok_ratio, 3)}
        print(f"[scheduler steady state, {sb['seconds'] + so['seconds']:.1f} s] resident requests: "
              f"baseline {sb['requests']} (mean length {sb['mean_len']}), "
              f"ours {so['requests']} (mean length {so['mean_len']}): {sched_res['ratio']:.2f}x requests, "
              f"{tok_ratio:.2f}x resident tokens")
    figures = {
        "seq_len": SEQ_LEN,
        "kv_bytes": kv_bytes,
        "ours_requests": ours["requests"],
        "baseline_requests": base["requests"],
        "ratio": round(ratio, 3),
        "bytes_ratio": round(bytes_ratio, 3),
        "config": str(args.config.name),
        "geometric_limit": round(geometric, 3),
        "target": 6.7,
        "ours": ours,
        "baseline": base,
        "scheduler": sched_res,
    }
    _results.record("kv_capacity", ap, args, figures, kind="simulation", baseline="one full pool (every layer, every token)",
                    summary=f"{ours['requests']} vs {base['requests']}, {ratio:.2f}x requests, {bytes_ratio:.2f}x KV bytes "
                            f"per request (limit {geometric:.2f}x)")


if __name__ == "__main__":
    _results.run(main)
