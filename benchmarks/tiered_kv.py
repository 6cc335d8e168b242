"""Tiered KV (device -> host -> Redis): hit rate, returning-session TTFT, bytes per restore.

Everything is wall-clock on the real engine (scheduler + runner + sampler, stepped in-process)
with a real Redis at ``--redis`` (127.0.0.1:6379); each run's L3 keys are dropped first.

1. **Hit rate at a fixed device budget** on an agent trace: ``--sessions`` sessions share a
   3,072-token system+tools prompt (1,024 with ``--quick``); each of ``--turns`` turns re-sends
   the whole conversation plus 32-128 new tokens (a tool result, user text) and gets an 8-token
   answer, sessions interleaved at random. The device pool holds 1/6 of the trace's distinct
   tokens (at least the longest request). Sides: device only
   (what vLLM / SGLang keep without offload), + host (2x the device pool), + host + Redis.
   Reported beside the trace's ideal (an infinite cache). Model: the tiny MiMo bundle (W = 128).
2. **Returning sessions**: a session's 4K-token prompt is computed, then evicted from the
   device by other sessions' prompts; its next turn's TTFT is measured when it is recomputed
   (device only), restored from the host, and restored from Redis (its host copy evicted too, as
   on another replica). Model: a Gemma 3 checkpoint (6 layers, 5 sliding W = 512 : 1 full,
   hidden 256) sized so that recomputing 4K tokens takes >= 100 ms here. Sides alternate every
   round; medians over ``--rounds``.
3. **Bytes per restored prefix** from Redis vs a transfer that is not SWA-masked (SWA KV for
   every token), and vs the bound: full-layer bytes of every token + W tokens of SWA bytes.

    flock /tmp/mmserve-bench.lock python -m benchmarks.tiered_kv [--quick]

The last line is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks import _results
from shared.redis_client import sync_client

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- engines
def make_engine(lm, settings, num_full: int, num_swa: int, host_full: int = 0, host_swa: int = 0,
                l3_url: str | None = None, page: int = 32, chunk: int = 512):
    from llm_svc.core.build import build_tiers, kv_dtype_of
    from mmserve.testing.in_process import InProcessEngine
    from llm_svc.engine.engine import Engine
    from llm_svc.engine.model_runner import ModelRunner
    from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
    from llm_svc.models import build_model

    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(window=model.window, max_batch_tokens=chunk, max_running=8,
                          l3_page_tokens=page if l3_url else 0)
    num_swa = max(num_swa, cfg.min_swa_slots())
    sched = Scheduler(cfg, num_full, num_swa, num_host_full=host_full, num_host_swa=host_swa)
    runner = ModelRunner(model, num_full, num_swa, kv_dtype=kv_dtype_of(settings, lm))
    tiers = None
    if host_full:
        s = settings.model_copy(update={"kv_l3_url": l3_url, "kv_l3_page_tokens": page,
                                        "host_kv_full_bytes": 1, "host_kv_swa_bytes": 1})
        tiers = build_tiers(s, lm, model, runner, sched, runner.kv_dtype)
        if tiers.l3 is not None:
            r = sync_client(l3_url)  # one Redis or a cluster (scan_iter walks every primary)
            for k in r.scan_iter(match=f"mmkv:{{{tiers.l3.fp}:*", count=1000):
                r.delete(k)
    return InProcessEngine(Engine(runner, sched, lm.eos_token_ids, tiers=tiers), lm.tokenizer)


class Sink:
    def __init__(self):
        self.tokens: list[int] = []
        self.first_at: float | None = None
        self.done = False
        self.cached = 0

    def put(self, out) -> None:
        if out.token_ids and self.first_at is None:
            self.first_at = time.perf_counter()
        self.tokens += out.token_ids
        if out.final:
            self.done = True
            self.cached = out.cached_tokens


def run_one(engine, rid: str, prompt: list[int], max_tokens: int) -> Sink:
    from llm_svc.types.request import PreparedRequest
    from shared.schemas import SamplingParams

    sink = Sink()
    engine.submit(PreparedRequest(request_id=rid, prompt_ids=list(prompt),
                                  sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)), sink)
    while not sink.done:
        engine.step()
    t = engine.engine.tiers
    if t is not None and t.l3 is not None:
        t.l3.flush()
    return sink


# ---------------------------------------------------------------------------- 1. hit rate
def agent_trace(sessions: int, turns: int, vocab: int, system_len: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(system_len)]
    order = [s for s in range(sessions) for _ in range(turns)]
    rng.shuffle(order)
    # each session's turns in order: re-sort the positions of one session's entries
    return system, order, rng


def ideal_hits(prompts_and_outputs: list[tuple[list[int], list[int]]]) -> float:
    """Hit rate of an infinite cache: each prompt reuses its longest prefix seen before."""
    seen: set[int] = set()
    hit = total = 0
    for prompt, out in prompts_and_outputs:
        hs, h = [], 0
        for t in prompt:
            h = hash((h, t))
            hs.append(h)
        lo, hi = 0, len(prompt) - 1  # admission matches at most all but the last token
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hs[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        hit += lo
        total += len(prompt)
        for t in out:
            h = hash((h, t))
            hs.append(h)
        seen.update(hs)
    return hit / total


def hit_rate(args, lm, settings) -> dict:
    vocab = lm.vocab_size
    system, order, rng = agent_trace(args.sessions, args.turns, vocab, args.system)
    convs = {s: list(system) for s in range(args.sessions)}
    plan = []
    for s in order:
        new = [rng.randrange(10, vocab) for _ in range(rng.randint(32, 128))]
        plan.append((s, new))
    distinct = len(system) + sum(len(n) + 8 for _, n in plan)
    longest = len(system) + args.turns * (128 + 8) + 64
    num_full = max(distinct // 6, longest)
    sides = {
        "device": dict(),
        "device+host": dict(host_full=2 * num_full, host_swa=num_full // 2),
        "device+host+redis": dict(host_full=2 * num_full, host_swa=num_full // 2, l3_url=args.redis,
                                  page=args.page),
    }
    out = {"distinct_tokens": distinct, "device_full_slots": num_full,
           "working_set_over_device": round(distinct / num_full, 2)}
    trace_for_ideal = None
    for name, kw in sides.items():
        eng = make_engine(lm, settings, num_full, 4 * 128 + 1200, **kw)
        convs = {s: list(system) for s in range(args.sessions)}
        record = []
        t0 = time.perf_counter()
        for i, (s, new) in enumerate(plan):
            prompt = convs[s] + new
            sink = run_one(eng, f"{name}-{i}", prompt, 8)
            record.append((prompt, sink.tokens))
            convs[s] = prompt + sink.tokens
        eng.scheduler.check_integrity()
        st = eng.engine.stats()
        out[name] = {"hit_rate": round(st["hit_rate"], 4), "seconds": round(time.perf_counter() - t0, 1),
                     "device_demoted_tokens": st.get("tree_demoted_full", 0),
                     "host_loaded_tokens": st.get("tree_loaded_full", 0),
                     "host_evictions": st.get("tree_host_evictions", 0),
                     "l3_hits": st.get("l3_hits", 0), "l3_hit_tokens": st.get("l3_hit_tokens", 0)}
        trace_for_ideal = record
        print(f"  {name:18s} hit rate {st['hit_rate']:.3f}  ({out[name]['seconds']} s)", flush=True)
        if eng.engine.tiers is not None:
            eng.engine.tiers.close()
    out["ideal"] = round(ideal_hits(trace_for_ideal), 4)
    return out


# ---------------------------------------------------------------------------- 2./3. returning sessions
def returning(args, lm, settings) -> dict:
    from llm_svc.attention import FULL, SLIDING

    rng = random.Random(1)
    vocab = lm.vocab_size
    n_prefix = args.prefix
    fill = 3  # other sessions' prompts that push it out of the device (and a small host)
    num_full = n_prefix + 2 * 1024 + 256
    sides = {
        "recompute": dict(),
        "host": dict(host_full=(fill + 2) * (n_prefix + 64), host_swa=(fill + 2) * 1024),
        "redis": dict(host_full=n_prefix + 512, host_swa=2048, l3_url=args.redis, page=args.page),
    }
    engines = {k: make_engine(lm, settings, num_full, 4096, **kw) for k, kw in sides.items()}
    ttft = {k: [] for k in sides}
    cached = {k: [] for k in sides}
    l3_bytes: list[int] = []
    for r in range(args.rounds):
        names = list(sides) if r % 2 == 0 else list(reversed(sides))
        prefix = [rng.randrange(10, vocab) for _ in range(n_prefix)]
        fillers = [[rng.randrange(10, vocab) for _ in range(n_prefix)] for _ in range(fill)]
        tail = [rng.randrange(10, vocab) for _ in range(32)]
        for name in names:
            eng = engines[name]
            first = run_one(eng, f"{name}-{r}-a", prefix, 4)
            for j, f in enumerate(fillers):
                run_one(eng, f"{name}-{r}-f{j}", f + [r], 1)
            before = eng.engine.stats().get("l3_bytes_read", 0)
            t0 = time.perf_counter()
            sink = run_one(eng, f"{name}-{r}-b", prefix + first.tokens + tail, 1)
            ttft[name].append(sink.first_at - t0)
            cached[name].append(sink.cached)
            if name == "redis":
                l3_bytes.append(eng.engine.stats()["l3_bytes_read"] - before)
        print(f"  round {r}: " + "  ".join(f"{k} {ttft[k][-1] * 1e3:.0f} ms (cached {cached[k][-1]})"
                                          for k in sides), flush=True)
    for eng in engines.values():
        eng.scheduler.check_integrity()
    p50 = {k: statistics.median(v) for k, v in ttft.items()}
    hkv = engines["redis"].engine.tiers.host
    w = engines["redis"].engine.scheduler.config.window
    restored = statistics.median(cached["redis"]) if cached["redis"] else 0
    full_b, swa_b = hkv.token_bytes(FULL), hkv.token_bytes(SLIDING)
    moved = statistics.median(l3_bytes) if l3_bytes else 0
    bound = restored * full_b + min(w, restored) * swa_b
    unmasked = restored * (full_b + swa_b)
    for eng in engines.values():
        if eng.engine.tiers is not None:
            eng.engine.tiers.close()
    return {
        "prefix_tokens": n_prefix,
        "ttft_p50_ms": {k: round(v * 1e3, 1) for k, v in p50.items()},
        "ttft_ms_all": {k: [round(x * 1e3, 1) for x in v] for k, v in ttft.items()},
        "host_over_recompute": round(p50["host"] / p50["recompute"], 3),
        "redis_over_recompute": round(p50["redis"] / p50["recompute"], 3),
        "cached_tokens_median": {k: statistics.median(v) for k, v in cached.items()},
        "bytes": {"restored_tokens": restored, "moved_from_redis": moved, "bound_full_plus_W_swa": bound,
                  "not_swa_masked": unmasked, "moved_over_bound": round(moved / bound, 4) if bound else None,
                  "moved_over_not_masked": round(moved / unmasked, 4) if unmasked else None},
    }


def _hit_summary(h: dict, page: int) -> str:
    tiers = " / ".join(f"{h[k]['hit_rate']:.3f}" for k in ("device", "device+host", "device+host+redis"))
    return f"hit rate {tiers} with {page}-token L3 pages (ideal {h['ideal']:.3f})"


def _returning_summary(r: dict) -> str:
    t, b = r["ttft_p50_ms"], r["bytes"]
    return (f"{r['prefix_tokens']}-token prefix: TTFT p50 {t['recompute']} ms recomputed, {t['host']} ms from host "
            f"({r['host_over_recompute']:.2f}x), {t['redis']} ms from Redis ({r['redis_over_recompute']:.2f}x); Redis bytes "
            f"{b['moved_over_bound']}x full KV + W of SWA, {b['moved_over_not_masked']}x an unmasked transfer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page", type=int, default=32, help="L3 page tokens (MMSERVE_LLM_KV_L3_PAGE_TOKENS)")
    ap.add_argument("--only", choices=["hit", "returning"], default=None, help="run one part")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:  # all three parts, every tier, on a short trace and prefix
        args.sessions, args.turns, args.rounds, args.prefix = 3, 2, 1, 512
    args.system = 256 if args.smoke else 1024 if args.quick else 3072
    args.sessions = args.sessions or (12 if args.quick else 20)
    args.turns = args.turns or (8 if args.quick else 14)
    args.rounds = args.rounds or (3 if args.quick else 6)

    import torch

    from benchmarks._vs_vllm_servers import CheckpointSpec, ensure_checkpoint
    from llm_svc.loading.loader import load_lm
    from shared.settings import LLMSettings
    from mmserve.tiny_model import write_tiny_model

    torch.set_num_threads(args.threads)
    cache = Path.home() / ".cache" / "mmserve" / "bench"
    tiny = cache / "tiered-tiny-mimo"
    if not (tiny / "config.json").exists() and not any(tiny.glob("*")):
        write_tiny_model(tiny)
    print(f"1. hit rate on an agent trace ({args.sessions} sessions x {args.turns} turns), tiny MiMo", flush=True)
    if args.only == "returning":
        ckpt = ensure_checkpoint(CheckpointSpec(hidden=256, intermediate=768, layers=6, heads=4, kv_heads=2,
                                                head_dim=64, window=512, vocab=4096))
        res = returning(args, load_lm(str(ckpt)), LLMSettings(model_dir=str(ckpt), max_model_len=8192))
        _results.record("tiered_kv", ap, args, {"returning": res, "page": args.page}, kind="wall-clock", baseline="device only (what vLLM / SGLang keep without offload); recompute; a transfer that is not SWA-masked",
                        summary=_returning_summary(res))
        return
    lm = load_lm(str(tiny))
    res_hit = hit_rate(args, lm, LLMSettings(model_dir=str(tiny)))
    if args.only == "hit":
        _results.record("tiered_kv", ap, args, {"hit_rate": res_hit, "page": args.page}, kind="wall-clock", baseline="device only (what vLLM / SGLang keep without offload); recompute; a transfer that is not SWA-masked",
                        summary=_hit_summary(res_hit, args.page))
        return
    ckpt = ensure_checkpoint(CheckpointSpec(hidden=256, intermediate=768, layers=6, heads=4, kv_heads=2,
                                            head_dim=64, window=512, vocab=4096))
    print(f"2. returning sessions, {args.prefix}-token prefix, Gemma 3 ({ckpt.name})", flush=True)
    lm2 = load_lm(str(ckpt))
    res_ret = returning(args, lm2, LLMSettings(model_dir=str(ckpt), max_model_len=8192))
    h = res_hit
    print()
    print("| side | hit rate | device demoted | host loaded | host evictions | L3 hits |")
    print("|---|---|---|---|---|---|")
    for k in ("device", "device+host", "device+host+redis"):
        v = h[k]
        print(f"| {k} | {v['hit_rate']:.3f} | {v['device_demoted_tokens']} | {v['host_loaded_tokens']} | "
              f"{v['host_evictions']} | {v['l3_hits']} |")
    print(f"| ideal (infinite cache) | {h['ideal']:.3f} | | | | |")
    print(f"working set / device pool = {h['working_set_over_device']}x")
    r = res_ret
    print()
    print(f"| returning session ({r['prefix_tokens']} tokens) | TTFT p50 | vs recompute |")
    print("|---|---|---|")
    for k in ("recompute", "host", "redis"):
        print(f"| {k} | {r['ttft_p50_ms'][k]} ms | {r['ttft_p50_ms'][k] / r['ttft_p50_ms']['recompute']:.2f}x |")
    b = r["bytes"]
    print(f"bytes from Redis per restore: {b['moved_from_redis']} = {b['moved_over_bound']}x the bound "
          f"(full KV of {b['restored_tokens']} tokens + W of SWA), {b['moved_over_not_masked']}x a transfer "
          "that is not SWA-masked")
    targets = {
        "hit_rate_all_tiers>=0.97": h["device+host+redis"]["hit_rate"] >= 0.97,
        "host_ttft<=0.5x": r["host_over_recompute"] <= 0.5,
        "redis_ttft<=0.5x": r["redis_over_recompute"] <= 0.5,
        "bytes_within_10%": (b["moved_over_bound"] or 9) <= 1.10,
    }
    print("targets:", ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in targets.items()))
    _results.record("tiered_kv", ap, args, {"hit_rate": h, "returning": r, "targets": targets, "page": args.page},
                    kind="wall-clock", baseline="device only (what vLLM / SGLang keep without offload); recompute; a transfer that is not SWA-masked", summary=f"{_hit_summary(h, args.page)}; {_returning_summary(r)}")


if __name__ == "__main__":
    _results.run(main)
