"""Decode step time vs context length: is the per-step cost flat in context?

Workload: the tiny MiMo bundle (7 layers: 1 full + 6 sliding with W=128; max positions raised
to 64K), ``B`` sequences (16 and 64) each holding ``C`` tokens of context (256, 2K, 8K, 32K),
all decoding. The prefill is skipped: each request is admitted straight into the decode state
with its KV slots reserved (zeros: the step's cost does not depend on the values), so a 32K x 64
point takes seconds, not an hour of CPU prefill. One step = what the engine does:
``scheduler.schedule()`` -> ``runner.run(batch)`` -> greedy pick -> ``scheduler.postprocess``.
Reported: the median over ``--steps`` timed steps (after warm-up), one torch thread.

"ours" is this tree; "before" is ``llm_svc`` as of ``--baseline-ref`` (the last commit before
persistent slot tables), exported to a temporary tree and run by the same code in a subprocess.

    flock /tmp/mmserve-bench.lock python -m benchmarks.step_scaling [--quick]

The last line of output is a JSON object with every point and the ratios 8K/256 and 32K/256.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _results
from shared.cache_dir import cache_root

REPO = Path(__file__).resolve().parents[1]
BASELINE_REF = "d5857b8"  # llm_svc before persistent slot tables (per-step slot lists)
CACHE = cache_root()
MAX_POS = 65536


def tiny_bundle() -> Path:
    """The tiny MiMo bundle with ``max_position_embeddings`` raised to ``MAX_POS`` (cached)."""
    out = CACHE / "step-scaling-mimo"
    if not (out / ".done").exists():
        from mmserve.tiny_model import write_tiny_model

        path = write_tiny_model(out)
        for cfg in Path(path).rglob("config.json"):
            d = json.loads(cfg.read_text())
            if "max_position_embeddings" in d and d.get("model_type", "").startswith("mimo"):
                d["max_position_embeddings"] = MAX_POS
                cfg.write_text(json.dumps(d, indent=2))
        (out / ".done").write_text("ok")
    return out


# ---------------------------------------------------------------------------------- worker
def _decoding_state(sched, req, ctx: int) -> None:
    """Admit ``req`` as if its prompt of ``ctx`` tokens had been prefilled except the last
    token: full slots for every position, SWA slots for the last window, next step a decode.
    Uses only scheduler/KV calls that exist in both trees."""
    try:
        from llm_svc.types.request import RequestStatus
    except ImportError:  # the baseline tree (before llm_svc.types.request)
        from llm_svc.engine.request import RequestStatus

    w = sched.config.window
    sched.waiting.remove(req)
    seq = sched.kv.start([])
    assert sched.kv.reserve(seq, ctx, max(0, ctx - w), ctx), "pool too small"
    req.kv, req.num_computed = seq, ctx - 1
    req.status, req.admitted_once, req.prefill_cached = RequestStatus.RUNNING, True, True
    sched.running.append(req)


def measure(lm, ctx: int, bs: int, steps: int, warmup: int, extra: dict) -> float:
    """Median ms per decode step of ``bs`` sequences at context ``ctx``."""
    import torch

    from llm_svc.engine.model_runner import ModelRunner
    from llm_svc.engine.scheduler import Scheduler, SchedulerConfig

    try:
        from llm_svc.types.request import Request
    except ImportError:  # the baseline tree (before llm_svc.types.request)
        from llm_svc.engine.request import Request
    from llm_svc.models import build_model
    from shared.schemas import SamplingParams

    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(max_batch_tokens=max(512, bs), max_running=bs, window=model.window,
                          enable_prefix_cache=False, policy="fcfs")
    total = warmup + steps
    num_full = bs * (ctx + total + 4)
    num_swa = max(cfg.min_swa_slots(), bs * (model.window + cfg.decode_release_interval + total + 4))
    sched = Scheduler(cfg, num_full, num_swa)
    runner = ModelRunner(model, num_full, num_swa, **extra)
    rng = random.Random(ctx * 1000 + bs)
    for i in range(bs):
        prompt = [rng.randrange(20, lm.vocab_size) for _ in range(ctx)]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=total + 2, ignore_eos=True))
        sched.add(req)
        _decoding_state(sched, req, ctx)
    times = []
    for step in range(total):
        t0 = time.perf_counter()
        batch = sched.schedule()
        assert batch is not None and len(batch.seqs) == bs and batch.num_tokens == bs
        logits = runner.run(batch)
        ids = list(logits)
        toks = torch.stack([logits[i] for i in ids]).argmax(-1).tolist()
        sched.postprocess(batch, dict(zip(ids, toks)))
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    sched.check_integrity()
    return statistics.median(times) * 1e3


def worker(spec: dict) -> dict:
    import torch

    from llm_svc.loading.loader import load_lm

    torch.set_num_threads(spec["threads"])
    if spec.get("attention_threads"):  # as the engine core sets it (this tree only)
        from llm_svc.attention import cpu_paged

        cpu_paged.set_threads(spec["attention_threads"])
        if hasattr(cpu_paged, "use_pool") and spec["attention_threads"] > 1:  # the core's decode steps: the C pool
            from llm_svc.models import cpu_gemv

            cpu_gemv.set_threads(spec["attention_threads"])
            cpu_paged.use_pool(cpu_gemv.par_for_address(), spec["attention_threads"])
    lm = load_lm(spec["model_dir"], dtype="float32")
    extra = {}
    if spec.get("kv_dtype"):
        extra["dtype"] = getattr(torch, spec["kv_dtype"])
    if spec.get("attention"):
        extra["attention"] = spec["attention"]
    out = {}
    for bs in spec["batches"]:
        for ctx in spec["contexts"]:
            ms = measure(lm, ctx, bs, spec["steps"], spec["warmup"], extra)
            out[f"{bs}x{ctx}"] = round(ms, 2)
            print(f"    [{spec['label']}] {bs:3d} seqs x {ctx:6d} ctx: {ms:8.2f} ms/step", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------- driver
def export_baseline(ref: str, dest: Path) -> Path:
    """``llm_svc`` at ``ref`` in ``dest``, with this tree's ``shared``, ``mmserve`` and ``benchmarks`` linked."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "llm_svc"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    for name in ("shared", "mmserve", "benchmarks"):
        (dest / name).symlink_to(REPO / name)
    return dest


def run_worker(spec: dict, cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_scaling", "--worker", json.dumps(spec)],
                          cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(cwd)})
    sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
    if proc.returncode:
        raise RuntimeError(f"{spec['label']} worker failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 sequences only, fewer steps (about a minute)")
    ap.add_argument("--contexts", default="256,2048,8192,32768")
    ap.add_argument("--batches", default=None, help="sequences per step (default 16,64; --quick 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (default 12; --quick 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention-threads", type=int, default=0,
                    help="threads a long decode's paged attention may split over (the engine core: every core; "
                         "0: --threads)")
    ap.add_argument("--kv-dtype", default=None, help="KV pool dtype of ours (float32, bfloat16); default float32")
    ap.add_argument("--attention", default=None, help="attention backend of ours (default: auto)")
    ap.add_argument("--baseline-ref", default=BASELINE_REF, help="git ref of the 'before' llm_svc ('' to skip)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    _results.add_mode_args(ap)
    args = ap.parse_args()
    skipped = []
    if args.smoke:  # two short contexts, one timed step, ours only
        args.contexts, args.batches, args.steps, args.warmup = "256,512", "2", 1, 1
        if args.baseline_ref:
            skipped.append(f"the {args.baseline_ref} baseline (a second interpreter and model load in an "
                           "exported tree, ~15 s): --quick runs it")
            args.baseline_ref = ""
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in (args.batches or ("16" if args.quick else "16,64")).split(",")]
    steps = args.steps or (5 if args.quick else 12)
    warmup = 2 if args.quick and not args.smoke else args.warmup
    base = {"model_dir": str(tiny_bundle()), "contexts": contexts, "batches": batches, "steps": steps,
            "warmup": warmup, "threads": args.threads}
    print(f"decode ms/step (median of {steps} after {warmup} warm-up), tiny MiMo, {args.threads} thread(s)")
    results = {"ours": run_worker({**base, "label": "ours", "kv_dtype": args.kv_dtype, "attention": args.attention,
                                   "attention_threads": args.attention_threads}, REPO)}
    if args.baseline_ref:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                tree = export_baseline(args.baseline_ref, Path(tmp) / "before")
                results["before"] = run_worker({**base, "label": "before"}, tree)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                print(f"baseline {args.baseline_ref} not measured: {e}")

    sides = list(results)
    print(f"\n{'seqs':>5} {'context':>8} " + " ".join(f"{s + ' ms':>12}" for s in sides)
          + ("  speedup" if "before" in results else ""))
    for bs in batches:
        for ctx in contexts:
            k = f"{bs}x{ctx}"
            row = " ".join(f"{results[s][k]:12.2f}" for s in sides)
            sp = f"  {results['before'][k] / results['ours'][k]:6.2f}x" if "before" in results else ""
            print(f"{bs:5d} {ctx:8d} {row}{sp}")
    ratios = {}
    for s in sides:
        for bs in batches:
            for ctx in contexts[1:]:
                if 256 in contexts:
                    ratios[f"{s}_{bs}_{ctx}/256"] = round(results[s][f"{bs}x{ctx}"] / results[s][f"{bs}x256"], 2)
    print("\nratios vs 256 context (targets, issue 21: 8K <= 1.3x, 32K <= 2x):")
    for k, v in ratios.items():
        print(f"  {k}: {v}x")
    figures = {"steps": steps, "threads": args.threads, "attention_threads": args.attention_threads or args.threads, "kv_dtype": args.kv_dtype or "float32",
               "ms_per_step": results, "ratios": ratios, "targets": {"8192/256": 1.3, "32768/256": 2.0}}
    ours = results["ours"]
    points = ", ".join(f"{k} {v:g} ms" for k, v in ours.items())
    summary = f"ours: {points}; " + ", ".join(f"{k.removeprefix('ours_')} {v}x" for k, v in ratios.items()
                                               if k.startswith("ours_"))
    if "before" in results:
        summary += "; before: " + ", ".join(f"{k} {v:g} ms" for k, v in results["before"].items())
    _results.record("step_scaling", ap, args, figures, kind="wall-clock",
                    baseline=f"llm_svc at {args.baseline_ref} (per-step slot lists)" if args.baseline_ref else "none",
                    summary=summary, skipped=skipped)


if __name__ == "__main__":
    _results.run(main)
